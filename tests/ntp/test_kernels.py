"""The exchange's Triton gather kernel against plain torch, run by Triton's CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

# Runs in a fresh interpreter: TRITON_INTERPRET must be set before the kernel is defined.
SCRIPT = """
import torch
from ntp.kernels import gather_rows_triton

torch.manual_seed(0)
for shape, dim in [((48, 40), 0), ((48, 40), 1), ((130, 300), 1), ((7, 5), 0), ((300, 9), 1)]:
    t = torch.randn(shape)
    moved = t.movedim(dim, 0)  # strided view: row-parallel weights gather columns
    index = torch.randperm(moved.shape[0])[: max(1, moved.shape[0] // 3)]
    out = torch.empty(len(index), moved.shape[1])
    gather_rows_triton(moved, index, out, 0.375)
    want = t.index_select(dim, index).movedim(dim, 0) * 0.375
    torch.testing.assert_close(out, want, rtol=1e-6, atol=0)
print("ok")
"""


def test_gather_kernel_matches_torch_under_the_interpreter():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
