"""A Hugging Face directory out, one tensor at a time: sharded safetensors files and their index,
config.json, and the tokenizer files and generation config the job started with.

A safetensors file is an 8-byte header length, a JSON header naming each tensor's dtype, shape
and byte range, then the tensors' bytes back to back. Every shape is known before anything is
read, so each file's header is written first and its tensors streamed after it, a rotated one
head by head in transformers' row order: the process holds the one tensor it writes, never a
shard.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ntp import hf
from ntp.model import ModelArgs, parameter_shapes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_NAMES = {torch.float32: ("F32", "float32"), torch.bfloat16: ("BF16", "bfloat16")}
# Beside a job's checkpoints: the files of the Hugging Face directory it started from.
CARRIED_DIR = "huggingface"


def _header(entries: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> bytes:
    """A safetensors header for these tensors in this order, padded to 8 bytes as the format's
    reference writer pads it (the data then starts aligned)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, size = 0, torch.empty((), dtype=dtype).element_size()
    for key, shape in entries:
        end = offset + size * int(torch.Size(shape).numel())
        header[key] = {"dtype": _NAMES[dtype][0], "shape": list(shape),
                       "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _shards(
    entries: Sequence[tuple[str, tuple[int, ...]]], element: int, max_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors in files of at most `max_bytes` (a larger tensor alone)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for key, shape in entries:
        size = element * int(torch.Size(shape).numel())
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append((key, shape))
        used += size
    return shards


def write_directory(
    directory: Path,
    args: ModelArgs,
    read: Callable[[str, torch.dtype], torch.Tensor],
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    carried: Sequence[Path] = (),
) -> None:
    """A Hugging Face directory of the project's model: each parameter (`read(name, dtype)`,
    in the project's order) renamed and reordered, in safetensors shards with an index when
    there are several; the `carried` files copied; config.json last.

    config.json is written last and atomically: a directory without it is an unfinished export
    that transformers does not load. The directory must be new or empty."""
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty: export into a new or empty directory")
    # a model no family holds is refused before any file is written
    config = hf.config_from_args(args, _NAMES[dtype][1])
    directory.mkdir(parents=True, exist_ok=True)
    shapes = parameter_shapes(args)
    entries = [(hf.hf_name(name), shape) for name, shape in shapes.items()]
    project = {hf.hf_name(name): name for name in shapes}
    element = torch.empty((), dtype=dtype).element_size()
    shards = _shards(entries, element, max_shard_bytes)
    # 1. Each file: its header, then its tensors one at a time.
    names = [hf.SINGLE] if len(shards) == 1 else [
        f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    for file, shard in zip(names, shards, strict=True):
        partial = directory / f"{file}.partial"
        with partial.open("wb") as out:
            out.write(_header(shard, dtype))
            for key, shape in shard:
                t = read(project[key], dtype).detach().to("cpu", dtype)
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{project[key]} is {tuple(t.shape)}, the model's is {shape}")
                rotated = hf.is_rotated(project[key])
                for rows in t.split(args.head_dim if rotated else max(t.shape[0], 1)):
                    piece = hf.pairs_to_halves(rows, args.head_dim) if rotated else rows
                    out.write(piece.contiguous().view(torch.uint8).numpy().data)
                del t  # before the next tensor is read
        os.replace(partial, directory / file)
    # 2. The index when there are several files, and what the job started with.
    if len(shards) > 1:
        weight_map = {key: file for file, shard in zip(names, shards, strict=True)
                      for key, _ in shard}
        total = element * sum(int(torch.Size(shape).numel()) for _, shape in entries)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / hf.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for path in carried:
        shutil.copy2(path, directory / path.name)
    # 3. config.json: from here on the directory is a complete model.
    partial = directory / f"{hf.CONFIG}.partial"
    partial.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(partial, directory / hf.CONFIG)


def carried_source(start: Path) -> Path | None:
    """Where the files a job carries from its start are: a Hugging Face directory itself, or
    the `huggingface/` beside a checkpoint (or inside a job's checkpoint directory)."""
    if hf.is_directory(start):
        return start
    for candidate in (start / CARRIED_DIR, start.parent / CARRIED_DIR):
        if candidate.is_dir():
            return candidate
    return None


def carried_files(start: Path) -> list[Path]:
    source = carried_source(start)
    return [] if source is None else hf.carried_files(source)


def keep_beside(start: Path, checkpoints: Path) -> None:
    """Copy the tokenizer files and generation config of what a job starts from into its
    checkpoint directory (once: a restart finds them there), for `tessera export-hf`."""
    target = checkpoints / CARRIED_DIR
    files = carried_files(start)
    if target.exists() or not files or carried_source(start) == target:
        return
    partial = checkpoints / f"{CARRIED_DIR}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for path in files:
        shutil.copy2(path, partial / path.name)
    os.replace(partial, target)
