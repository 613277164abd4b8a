"""The `tessera import-hf` and `tessera export-hf` commands (docs/huggingface.md): a Hugging Face
directory as a job's first checkpoint, and a checkpoint as a Hugging Face directory, both one
tensor at a time."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors import SafetensorError

from ntp import checkpoint, hf, hf_read, hf_write
from ntp.model import parameter_shapes

ERRORS = (OSError, ValueError, SafetensorError)


def _fail(command: str, exc: BaseException) -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"tessera {command}: {message}", file=sys.stderr)
    return 2


def import_main(argv: list[str] | None = None) -> int:
    """`tessera import-hf HF_DIR CHECKPOINT_DIR [--seq-len N]`: a job's initial checkpoint."""
    parser = argparse.ArgumentParser(
        prog="tessera import-hf",
        description="Write a Hugging Face directory (Llama, Mistral, Qwen2, Qwen3) as the first "
        "checkpoint (step 0) of a job's checkpoint directory, one tensor at a time: the "
        "project's names, RoPE order and float32. Its tokenizer files and generation config "
        "go beside it, for `tessera export-hf`.",
    )
    parser.add_argument("hf_dir", type=Path, metavar="HF_DIR")
    parser.add_argument("checkpoint_dir", type=Path, metavar="CHECKPOINT_DIR")
    parser.add_argument("--seq-len", type=int,
                        help="the job's sequence length (default: max_position_embeddings, or "
                        "the sliding window where shorter)")
    opts = parser.parse_args(argv)
    try:
        args = hf.args_from_config(hf.read_config(opts.hf_dir), opts.seq_len)
        existing = checkpoint.latest(opts.checkpoint_dir)
        if existing is not None:
            raise ValueError(f"{opts.checkpoint_dir} already holds checkpoint {existing}: "
                             "import into a new job's checkpoint directory")
        files = hf_read.open_directory(opts.hf_dir, args)
        path = checkpoint.write_dense(
            opts.checkpoint_dir, parameter_shapes(args),
            lambda name: hf_read.read_dense(opts.hf_dir, files, args, name), args,
        )
        hf_write.keep_beside(opts.hf_dir, opts.checkpoint_dir)
    except ERRORS as exc:
        return _fail("import-hf", exc)
    print(f"tessera import-hf: wrote {path} (spec.model: {json.dumps(args.shape().to_spec())})")
    return 0


def export_main(argv: list[str] | None = None) -> int:
    """`tessera export-hf CHECKPOINT OUT_DIR [--dtype bf16|fp32]`: a checkpoint's weights as a
    Hugging Face directory."""
    parser = argparse.ArgumentParser(
        prog="tessera export-hf",
        description="Write a checkpoint's weights as a Hugging Face directory (config.json, "
        "sharded safetensors and their index, the tokenizer files and generation config of "
        "the directory the job started from), one tensor at a time. CHECKPOINT: one "
        "checkpoint, or a job's checkpoint directory (its newest complete checkpoint).",
    )
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument("--dtype", choices=sorted(hf_write.DTYPES), default="fp32",
                        help="the weights' precision on disk (default: fp32, the checkpoint's)")
    parser.add_argument("--max-shard-bytes", type=int, default=5 * 2**30,
                        help="the largest safetensors file (a larger tensor alone; default 5 GiB)")
    opts = parser.parse_args(argv)
    try:
        ckpt = checkpoint.latest(opts.checkpoint)
        if ckpt is None or hf.is_directory(ckpt):
            raise ValueError(f"{opts.checkpoint} holds no complete checkpoint")
        hf_write.write_directory(
            opts.out_dir, checkpoint.read_args(ckpt),
            lambda name, dtype: checkpoint.read_dense(ckpt, name, dtype=dtype),
            hf_write.DTYPES[opts.dtype],
            opts.max_shard_bytes, hf_write.carried_files(ckpt),
        )
    except ERRORS as exc:
        return _fail("export-hf", exc)
    print(f"tessera export-hf: wrote {opts.out_dir} from {ckpt}")
    return 0
