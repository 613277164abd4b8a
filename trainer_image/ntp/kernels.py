"""Triton kernel for the gradient exchange: gather unit slices into a send buffer, scaled.

Packing a bucket for the exchange reads scattered rows (or, for row-parallel weights, scattered
columns) of each gradient, scales them by the replica's sample weight and lays them out
unit-major. One kernel pass does all three on the GPU; elsewhere torch does it in two.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the trainer runs without Triton; only the GPU fast path needs it
    triton = None

BLOCK_ROWS = 16
BLOCK_COLS = 128

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(
        src,
        index,
        out,
        n_rows,
        n_cols,
        stride_row,
        stride_col,
        scale,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # out[r, c] = src[index[r], c] * scale, src with any strides (a moved-dim view).
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        picked = tl.load(index + rows, mask=row_ok, other=0)
        values = tl.load(
            src + picked[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0
        )
        tl.store(out + rows[:, None] * n_cols + cols[None, :], values * scale, mask=mask)


def gather_rows_triton(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor, scale: float):
    """out = src[index] * scale with the Triton kernel (GPU, or CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    n_rows, n_cols = out.shape
    grid = (triton.cdiv(n_rows, BLOCK_ROWS), triton.cdiv(n_cols, BLOCK_COLS))
    _gather_rows_kernel[grid](
        src,
        index,
        out,
        n_rows,
        n_cols,
        src.stride(0),
        src.stride(1),
        scale,
        BLOCK_R=BLOCK_ROWS,
        BLOCK_C=BLOCK_COLS,
    )


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """out[k] = src[index[k]] * scale for a 2-D `src` of any strides and a contiguous `out`."""
    if src.is_cuda and triton is not None and out.numel():
        gather_rows_triton(src, index, out, scale)
        return
    torch.index_select(src, 0, index, out=out)
    if scale != 1.0:
        out.mul_(scale)
