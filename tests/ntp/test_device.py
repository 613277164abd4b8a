"""Device and precision: `--device auto` takes a GPU per rank when the host has them, else the
CPU; bf16 autocasts the compute while weights, AdamW moments and gradient reductions stay fp32.
GPU paths are marked `gpu` and skip where no CUDA device is visible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rounding import FLOAT64_ROUNDING, rounding_bound

from ntp.distributed import pick_device
from ntp.launch import launch_local
from ntp.model import FLAVORS
from tessera_core.plan import plan_job

ARGS = FLAVORS["debug"]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("ranks_here", [1, 2, 8])
def test_auto_takes_a_gpu_per_rank_or_the_cpu(monkeypatch, ranks_here):
    monkeypatch.setenv("WORLD_SIZE", str(ranks_here))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_here))
    monkeypatch.setenv("RANK", "0")
    want = "cuda:0" if ranks_here <= GPUS else "cpu"
    assert pick_device("auto") == want
    assert pick_device("cpu") == "cpu"


def test_cuda_without_enough_gpus_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(GPUS + 1))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="needs"):
        pick_device("cuda")


def train(tmp: Path, *extra: str, degrees: tuple[int, ...] = (2, 1)) -> tuple[list[float], dict]:
    layout = plan_job(ARGS.shape(), list(degrees), global_batch=6)
    launch_local(layout, ["--flavor", "debug", "--steps", "4", "--out", str(tmp), "--dump",
                          *extra], timeout_s=150)
    losses = json.loads((tmp / "rank0.json").read_text())["losses"]
    return losses, torch.load(tmp / "state-rank0.pt")


# bf16 keeps 8 significant bits (unit roundoff 2^-8). On the loss's dependency path each layer
# rounds the inputs of its seven matrix products (Q, K, V, O, gate, up, down) and the LM head one
# more: the loss moves by at most that many relative roundings of its own size.
BF16_ROUNDING = 2.0**-8
BF16_ROUNDINGS = 7 * ARGS.n_layers + 1


def test_bf16_computes_in_bf16_and_keeps_fp32_state(tmp_path):
    full, full_state = train(tmp_path / "fp32", "--device", "cpu")
    half, half_state = train(tmp_path / "bf16", "--device", "cpu", "--precision", "bf16")
    bound = BF16_ROUNDING * BF16_ROUNDINGS
    assert all(abs(h - f) <= bound * f for h, f in zip(half, full, strict=True)), (half, full)
    assert half != full  # the compute really ran in bf16
    for name, tensors in half_state.items():
        assert all(t.dtype == torch.float32 for t in tensors), name
        assert len(tensors) == 3, name  # weight and both moments, fp32
    assert half[-1] < half[0]


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 3, reason="needs a CUDA device per rank (3)")
def test_auto_trains_on_the_gpus_with_nccl(tmp_path):
    cpu, _ = train(tmp_path / "cpu", "--device", "cpu")
    gpu, state = train(tmp_path / "gpu")  # --device auto
    assert all(t.dtype == torch.float32 for ts in state.values() for t in ts)
    # The same fp32 math on another device (TF32 is off by default for matmuls), reduced in
    # another order: two float32 evaluations, each within u32 x the operations on the longest
    # dependency path (`rounding_bound`'s count, test_model.py).
    operations = rounding_bound(ARGS, 6) / (2 * FLOAT64_ROUNDING)
    assert gpu == pytest.approx(cpu, rel=2 * 2.0**-24 * operations)
