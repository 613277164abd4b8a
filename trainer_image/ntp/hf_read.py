"""Hugging Face weights in without a dense copy: a rank reads only its own units from the
safetensors files (sliced reads), and `tessera import-hf` one tensor at a time.

Every read is a slice of rows (a unit's rows, or all rows of a unit's columns for a
row-parallel weight) in blocks of at most `BLOCK_BYTES` (as float32), converted to float32
straight into the parameter. The file is opened for each block alone: the pages safetensors maps
to read it are released before the next. So a process holds its shard and one block besides;
bfloat16 and float16 widen exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ntp import hf
from ntp.model import ModelArgs, parameter_shapes
from ntp.sharding import local_positions, runs, spec_of, unit_size
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import RankShard

BLOCK_BYTES = 4 * 2**20


def open_directory(directory: Path, args: ModelArgs) -> dict[str, Path]:
    """Each stored tensor's file, once the headers show every tensor `args`' model needs, of its
    shape and floating point, and nothing else (a ValueError names the difference)."""
    files = hf.tensor_files(directory)
    hf.check_directory(directory, files, args, parameter_shapes(args))
    return files


def _read_rows(
    path: Path, stored: str, out: torch.Tensor, rows: tuple[int, int],
    cols: tuple[int, int] | None, name: str, head_dim: int,
) -> None:
    """`out` = rows [rows) (and columns [cols) when given) of a stored tensor, in blocks; a
    rotated tensor's rows come in whole heads and are reordered into the project's order."""
    first, end = rows
    row_bytes = out[0].numel() * 4 if out.dim() > 1 else 4
    align = head_dim if hf.is_rotated(name) else 1
    block = max(align, BLOCK_BYTES // row_bytes // align * align)
    for lo in range(first, end, block):
        hi = min(lo + block, end)
        with safe_open(path, framework="pt") as f:
            rows_of = f.get_slice(stored)
            piece = rows_of[lo:hi] if cols is None else rows_of[lo:hi, cols[0] : cols[1]]
        hf.copy_from_hf(out[lo - first : hi - first], piece, name, head_dim)
        del piece


def load_units(
    directory: Path, files: Mapping[str, Path], model: nn.Module, shape: ModelShape,
    shard: RankShard,
) -> None:
    """Fill an allocated model holding `shard`'s units (a rank's, or all of them: the dense
    model) with their values in a Hugging Face directory, reading only those rows or columns."""
    head_dim = shape.head_dim
    with torch.no_grad():
        for name, p in model.named_parameters():
            stored, spec = hf.hf_name(name), spec_of(name)
            path = files[stored]
            if spec is None:
                _read_rows(path, stored, p, (0, p.shape[0]), None, name, head_dim)
                continue
            size = unit_size(shape, spec.kind)
            held = shard.units(spec.kind)
            for first, at, n in runs(held, local_positions(held, held)):
                out = p.narrow(spec.dim, at * size, n * size)
                span = (first * size, (first + n) * size)
                if spec.dim == 0:
                    _read_rows(path, stored, out, span, None, name, head_dim)
                else:  # a row-parallel weight: these columns of every row
                    _read_rows(path, stored, out, (0, p.shape[0]), span, name, head_dim)


def read_dense(
    directory: Path, files: Mapping[str, Path], args: ModelArgs, name: str
) -> torch.Tensor:
    """One parameter of the model, whole, float32 in the project's order."""
    out = torch.empty(parameter_shapes(args)[name])
    with torch.no_grad():
        _read_rows(files[hf.hf_name(name)], hf.hf_name(name), out, (0, out.shape[0]), None,
                   name, args.head_dim)
    return out
