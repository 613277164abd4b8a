"""failurePolicy.mode CKPT-RESTART on the local cluster (2 nodes x 2 GPUs), the baseline a JobSet
user runs: a job of TP2 x DP1 with totalGPUs 4 (one node's GPUs spare) checkpoints every few
steps on a shared claim; a GPU under its layout falls off the bus (`tessera-dev fail-gpu`, XID
79). The attempt ends: every trainer pod is replaced, and the job resumes from its newest
complete checkpoint on the other node, the only whole node left with no failed GPU, then
completes. The time without pods is restart badput in its status.

The losses are compared with an uninterrupted run of the same job (the local launcher, same
seed, one TP2 replica throughout): the steps from the checkpoint to the fault are trained twice,
each time at that run's loss, and the resumed attempt trains every step after the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from jobharness import GPUS, HANG_S, JobFlow, records, shared, small_job
from test_job_lifecycle import LOSS_TOLERANCE, _apply, _finished, _losses, _trainer_pods
from test_job_training import _complete

from tessera_contracts.api import ATTEMPT_LABEL
from tessera_contracts.generation import Gpu
from tessera_dev.reference import failure_free_losses
from tessera_dev.simnode import faults

pytestmark = [pytest.mark.jobapi, pytest.mark.recovery]

JOB = "baseline"
# Long enough that the fault lands mid-run on a loaded machine; short enough to finish.
STEPS, INTERVAL = 100, 5
LOST = ("gpu-node-0", "1")  # a GPU of the layout (the plan puts the replica on the first node)


def _reference(job: dict[str, Any], tmp: Path) -> dict[int, float]:
    """Global rank 0's losses by step of the same job without a failure: one TP2 replica."""
    return failure_free_losses(job["spec"], (tuple(Gpu("gpu-node-0", i) for i in range(GPUS)),),
                               tmp, timeout_s=HANG_S)


def _follow(flow: JobFlow, pods: list[dict[str, Any]]) -> list[subprocess.Popen[str]]:
    """`kubectl logs -f` of `pods`: each ends with its container, holding every line its ranks
    printed (a pod, once deleted, has no logs to ask for)."""
    env = os.environ | {"KUBECONFIG": str(flow.plane.kubeconfig)}
    return [subprocess.Popen(["kubectl", "-n", flow.namespace, "logs", "-f",
                              p["metadata"]["name"]], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env) for p in pods]


def _events(flow: JobFlow, reason: str) -> list[str]:
    listed = flow.kubectl("get", "events", "--field-selector", f"reason={reason}", "-o", "json")
    return [e["message"] for e in json.loads(listed.stdout)["items"]]


def test_a_gpu_lost_under_the_layout_restarts_the_job_from_its_checkpoint_on_the_spare(
        flow, tmp_path):
    claim, files = shared(flow, "checkpoints")
    job = small_job(JOB, claim, steps=STEPS, interval=INTERVAL)
    job["spec"]["dataParallelReplicas"] = 1
    job["spec"]["failurePolicy"]["mode"] = "CKPT-RESTART"
    reference = _reference(job, tmp_path / "reference")
    _apply(flow, job, tmp_path)
    first = flow.wait("both trainer pods running", lambda: _trainer_pods(flow, JOB),
                      lambda pods: len(pods) == 2 and all(
                          p["status"].get("phase") == "Running" for p in pods))
    followers = _follow(flow, first)
    try:
        # 1. Past a checkpoint, a GPU of the layout falls off the bus.
        flow.wait(f"training past step {INTERVAL + 3}", lambda: max(_losses(flow, JOB),
                                                                    default=0),
                  lambda step: step >= INTERVAL + 3)
        assert faults.fail_gpu([*LOST, "--xid", "79", "--data-dir",
                                str(flow.plane.data_dir)]) == 0
        failed = time.monotonic()

        # 2. The attempt ends: a restart, counted against maxRestarts; no live relayout.
        status = flow.wait("the restart", lambda: flow.status(JOB),
                           lambda s: s.get("restarts") == 1)
        assert status["attempt"] == 1 and status.get("layoutGeneration", 0) <= 1, status
        newest = max(_complete(files / "run").values())
        (told,) = flow.wait("the event that says why", lambda: _events(flow, "LayoutGPULost"))
        assert f"{LOST[0]}/{LOST[1]}" in told and "CKPT-RESTART" in told, told

        # 3. Every trainer pod replaced: the new attempt on the other node only (the one with
        #    the failed GPU is no candidate), from the newest complete checkpoint.
        flow.wait("the next attempt training", lambda: _losses(flow, JOB, 1), bool)
        back_s = time.monotonic() - failed
        second = _trainer_pods(flow, JOB)
        assert {p["metadata"]["labels"][ATTEMPT_LABEL] for p in second} == {"1"}
        assert not {p["metadata"]["uid"] for p in second} & {p["metadata"]["uid"]
                                                              for p in first}
        assert {p["spec"]["nodeName"] for p in second} == {"gpu-node-1"}

        status = _finished(flow, JOB)
        assert [c for c in status["conditions"] if c["type"] == "Complete"][0]["status"] \
            == "True", status
    finally:
        faults.restore_gpu([*LOST, "--data-dir", str(flow.plane.data_dir)])
    before: dict[int, float] = {}
    for follower in followers:
        for r in records(follower.communicate(timeout=HANG_S)[0].splitlines()):
            if "loss" in r:
                before.setdefault(r["step"], r["loss"])

    # 4. The losses: attempt 0 up to the fault, attempt 1 from the checkpoint to the end, each
    #    step at the uninterrupted run's loss; the steps between were trained in both.
    after = _losses(flow, JOB, 1)
    resumed = min(after)
    assert resumed == newest + 1 and newest % INTERVAL == 0 and newest >= INTERVAL, (
        newest, sorted(after))
    assert sorted(after) == list(range(resumed, STEPS + 1))
    hit = max(before)
    redone = list(range(resumed, hit + 1))
    assert set(redone) <= set(before) and set(redone) <= set(after)
    assert before == pytest.approx({s: reference[s] for s in before}, abs=LOSS_TOLERANCE)
    assert after == pytest.approx({s: reference[s] for s in after}, abs=LOSS_TOLERANCE)
    earlier = status["earlierAttempts"]
    assert earlier["badputSeconds"]["restart"] > 0 and status["goodput"] < 1
    print(f"\nGPU {LOST[0]}/{LOST[1]} lost at step {hit} -> the next attempt's first step "
          f"(step {resumed}, on gpu-node-1): {back_s:.1f} s; {len(redone)} steps redone; "
          f"restart badput {earlier['badputSeconds']['restart']:.1f} s, lost progress "
          f"{earlier['badputSeconds'].get('lost_progress', 0.0):.1f} s (node-seconds); job "
          f"goodput {status['goodput']:.3f}")
