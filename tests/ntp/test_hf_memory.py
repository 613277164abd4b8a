"""Weights in and out without a dense copy, measured: a rank starting from a sharded bfloat16
Hugging Face directory, `tessera import-hf` and `tessera export-hf` each hold at most their
shard (nothing, for the commands) plus one tensor.

Each is measured in a fresh process: its peak resident size (VmHWM, reset after the imports)
above its resident size then. Mapped file pages count: a safetensors file read through mmap is
resident while it is mapped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ntp import hf, hf_read
from ntp.model import ModelArgs, parameter_shapes

pytestmark = pytest.mark.models

# 58 M parameters (232 MB in float32, 116 MB on disk in bfloat16), in 8 files; the largest
# tensor is an MLP weight of 4 M elements (16 MB in float32).
ARGS = ModelArgs(dim=1024, n_layers=3, n_heads=16, n_kv_heads=4, ffn_dim=4096, vocab_size=2048,
                 max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5)
FILES = 8

MEASURE = """
import json, sys
from pathlib import Path
import torch

def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

from ntp import checkpoint, hf_cli
from ntp.initialize import materialize
from ntp.model import Transformer
from ntp.parallelize import apply_ntp
from tessera_core.plan import plan_job
source, work, what = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
args = checkpoint.read_args(source)
shard = plan_job(args.shape(), [4], global_batch=4).replicas[0].shards[1]
with torch.device("meta"):  # loads what meta construction needs once (code, not the model)
    Transformer(args)
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts from the current size
before = status("VmRSS")
held = 0
if what == "rank":  # TP4's rank 1 starts from the directory
    with torch.device("meta"):
        model = Transformer(args)
    apply_ntp(model, shard, group=None)
    materialize(model, "cpu")
    checkpoint.load_state(source, model, None, args.shape(), shard)
    held = sum(p.numel() * 4 for p in model.parameters())
elif what == "import":
    assert hf_cli.import_main([str(source), str(work / "job")]) == 0
else:
    assert hf_cli.export_main([str(work / "job"), str(work / "out"), "--dtype", "bf16",
                               "--max-shard-bytes", str(32 * 2**20)]) == 0
print(json.dumps({"peak": status("VmHWM") - before, "held": held}))
"""


def write_directory(directory: Path) -> None:
    """A bfloat16 Hugging Face directory of ARGS in FILES safetensors files and their index,
    as `save_pretrained` shards one (values are irrelevant here, sizes are what counts)."""
    directory.mkdir()
    shapes = {hf.hf_name(n): s for n, s in parameter_shapes(ARGS).items()}
    names = list(shapes)
    per_file = -(-len(names) // FILES)
    weight_map = {}
    for k in range(FILES):
        file = f"model-{k + 1:05d}-of-{FILES:05d}.safetensors"
        part = names[k * per_file : (k + 1) * per_file]
        save_file({n: torch.full(shapes[n], 0.5, dtype=torch.bfloat16) for n in part},
                  str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (directory / hf.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = hf.config_from_args(ARGS, "bfloat16")
    (directory / hf.CONFIG).write_text(json.dumps(config))


def measure(source: Path, work: Path, what: str) -> dict:
    # A fixed mmap threshold: glibc's adaptive one would keep freed temporaries on the heap, so
    # the resident size would count memory no longer allocated.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(source), str(work), what],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_process_holds_more_than_its_shard_and_one_tensor(tmp_path, capsys):
    source = tmp_path / "hf"
    write_directory(source)
    shapes = parameter_shapes(ARGS)
    largest = max(4 * torch.Size(s).numel() for s in shapes.values())
    dense = sum(4 * torch.Size(s).numel() for s in shapes.values())
    rank = measure(source, tmp_path, "rank")
    imported = measure(source, tmp_path, "import")
    exported = measure(source, tmp_path, "export")
    # A rank: its shard, allocated, plus one block read (its piece and the pages mapped to
    # read it), smaller than one tensor.
    assert rank["peak"] <= rank["held"] + largest, rank
    # import-hf: the one tensor it converts to float32, plus one block read.
    assert imported["peak"] <= largest + hf_read.BLOCK_BYTES, imported
    # export-hf: the one tensor it writes. DCP's reader loads the stored float32 tensor whole
    # (torch.load) and copies it into the bfloat16 one, which is written head by head: two
    # copies of one tensor at most, and nothing that grows with the model.
    assert exported["peak"] <= 2 * largest + hf_read.BLOCK_BYTES, exported
    with capsys.disabled():
        mib = 2**20
        print(f"\npeak above the process's start (dense model {dense / mib:.0f} MiB float32, "
              f"largest tensor {largest / mib:.0f} MiB): TP4 rank reading its units "
              f"{rank['peak'] / mib:.0f} MiB for a {rank['held'] / mib:.0f} MiB shard; "
              f"import-hf {imported['peak'] / mib:.0f} MiB; export-hf --dtype bf16 "
              f"{exported['peak'] / mib:.0f} MiB")
