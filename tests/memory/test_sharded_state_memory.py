"""With the optimizer state sharded across replicas (`--sharded-state`), each rank's measured peak
tensor memory in a steady step against the memory plan's figure for it, which counts only the
owned units' master weights and moments (`tessera_core.sharded_state`); bounds as
tests/memory/test_measured.py derives them."""

from __future__ import annotations

import json

import pytest
from test_measured import CASES, within

from ntp.launch import launch_local
from tessera_core.memory import Training, rank_memory
from tessera_core.plan import plan_job

pytestmark = pytest.mark.memory

SHAPE, DEGREES, BATCH = CASES[0][1], (2, 2), 8


def test_each_rank_keeps_the_optimizer_state_the_plan_gives_it(tmp_path, capsys):
    layout = plan_job(SHAPE, DEGREES, BATCH)
    args = ["--steps", "2", "--device", "cpu", "--out", str(tmp_path), "--measure-memory",
            "--sharded-state"]
    env = {"TESSERA_COLLECTIVE_TIMEOUT_S": "120", "TESSERA_RENDEZVOUS_TIMEOUT_S": "120"}
    launch_local(layout, args, timeout_s=600, env=env)
    rows = []
    for g in range(layout.world_size):
        replica, rank = layout.locate(g)
        peak = json.loads((tmp_path / f"rank{g}.json").read_text())["peak_bytes"][-1]
        sharded = rank_memory(layout, replica, rank, Training(sharded_state=True))
        whole = rank_memory(layout, replica, rank, Training())
        rows.append((f"  rank {g}: measured {peak / 2**20:.3f} MiB, plan {sharded.peak / 2**20:.3f}"
                     f" MiB (unsharded {whole.peak / 2**20:.3f}); optimizer state "
                     f"{(whole.optimizer + whole.master) / 2**20:.3f} -> "
                     f"{(sharded.optimizer + sharded.master) / 2**20:.3f} MiB",
                     within(peak, sharded.peak)))
    with capsys.disabled():
        print("\n[sharded optimizer state, TP2 x DP2]\n" + "\n".join(r for r, _ in rows))
    assert all(ok for _, ok in rows), [r for r, ok in rows if not ok]
