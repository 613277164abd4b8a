"""A job's life on the local cluster, driven as a platform team drives it: a job that mounts a
shared claim, reads a secret and gets a memory /dev/shm trains, checkpoints there and completes
(`kubectl wait --for=condition=Complete`), then goes with its TTL; a job suspended in the middle
of a relayout holds no pod and no power target until resumed, and continues the loss sequence
from its checkpoint; a trainer pod killed for a reason other than a GPU is restarted within the
budget and the job carries on from its checkpoint; pods a Pod Security level refuses are a
condition, not a silent stall; a job another controller manages is left alone.

The losses are compared with a failure-free run of the same job (the local launcher, same seed):
the steps each attempt trains are each done once after the checkpoint it resumed from, at the
losses of that run within 1e-4 (the bound the user-flow test holds different layouts to).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from jobharness import GPUS, NODES, JobFlow, condition, records, shared, small_job
from kubernetes import client

from tessera_contracts.api import ATTEMPT_LABEL, ROLE_LABEL
from tessera_contracts.generation import Gpu
from tessera_dev.reference import failure_free_losses

pytestmark = pytest.mark.jobapi

LOSS_TOLERANCE = 1e-4
STEPS = 120  # a job the tests let finish
UNFINISHABLE = 100_000  # the example's steps: a job the tests stop themselves


def _finished(flow: JobFlow, name: str) -> dict[str, Any]:
    """The job's status once it is Complete or Failed (what `kubectl wait` waits for)."""
    return flow.wait(f"{name} Complete or Failed", lambda: flow.status(name), lambda s: any(
        condition(s, kind).get("status") == "True" for kind in ("Complete", "Failed")))


def _apply(flow: JobFlow, job: dict[str, Any], tmp_path: Path) -> None:
    manifest = tmp_path / f"{job['metadata']['name']}.yaml"
    manifest.write_text(yaml.safe_dump(job))
    flow.kubectl("apply", "-f", str(manifest))


def _trainer_pods(flow: JobFlow, name: str) -> list[dict[str, Any]]:
    return [p for p in flow.pods(name) if p["metadata"]["labels"].get(ROLE_LABEL) == "trainer"]


def _losses(flow: JobFlow, name: str, attempt: int | None = None) -> dict[int, float]:
    """Step -> loss, as the ranks of the job's trainer pods (of `attempt`) logged them."""
    losses: dict[int, float] = {}
    for pod in _trainer_pods(flow, name):
        if attempt is not None and pod["metadata"]["labels"].get(ATTEMPT_LABEL) != str(attempt):
            continue
        for r in records(flow.logs(pod["metadata"]["name"])):
            if "loss" in r:
                losses.setdefault(r["step"], r["loss"])
    return losses


def _complete_checkpoints(run: Path) -> list[str]:
    """The names of the complete checkpoints under `run`, oldest first (zero-padded steps):
    renamed from .partial, and with their tessera.json (written last, before the rename)."""
    return sorted(d.name for d in run.glob("step-*")
                  if d.suffix != ".partial" and (d / "tessera.json").is_file())


def _reference(job: dict[str, Any], tmp: Path) -> dict[int, float]:
    """Global rank 0's losses by step of the same job without failures (the local launcher,
    its first layout throughout)."""
    replicas = tuple(tuple(Gpu(f"gpu-node-{r}", i) for i in range(GPUS)) for r in range(NODES))
    return failure_free_losses(job["spec"], replicas, tmp, timeout_s=600)


def _agent_pid(node: str, job: str) -> int:
    """The host pid of the node agent of `job` on simulated `node` (its container's main
    process, which the node runs in namespaces of its own)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ntp.nodeagent" in argv and job.encode() in argv and \
                f"NODE_NAME={node}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no node agent of {job} on {node}")


def test_a_job_with_a_claim_a_secret_and_shm_trains_checkpoints_and_completes(flow, tmp_path):
    claim, files = shared(flow, "checkpoints")
    client.CoreV1Api(flow.api).create_namespaced_secret(flow.namespace, {
        "metadata": {"name": "training"}, "stringData": {"lr": "0.001"}})
    job = small_job("rich", claim, steps=24, interval=10)
    # The learning rate comes from the secret, through the environment into every rank's
    # command line ($(VAR) in args): the job trains only if the secret reached the container.
    job["spec"]["args"] = ["--lr=$(TRAINING_LR)"]
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    trainer["env"] = [{"name": "TRAINING_LR", "valueFrom": {"secretKeyRef": {
        "name": "training", "key": "lr"}}}]
    job["spec"]["ttlSecondsAfterFinished"] = 5
    _apply(flow, job, tmp_path)
    pods = flow.wait("the trainer pods", lambda: _trainer_pods(flow, "rich"),
                     lambda p: len(p) == NODES)
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
        assert volumes[mounts["/checkpoints"]]["persistentVolumeClaim"]["claimName"] == claim

    waited = flow.kubectl("wait", "--for=condition=Complete", "ntpjob/rich", "--timeout=600s",
                          check=False)
    assert waited.returncode == 0, (waited.stderr, flow.status("rich"))
    # Every 10 steps and at the end, on the claim every node shares: the newest complete
    # checkpoint is the last step's.
    complete = _complete_checkpoints(files / "run")
    assert complete and complete[-1] == "step-00000024", sorted(
        str(p.relative_to(files)) for p in files.glob("*/*"))
    # The TTL: the job goes, and its pods with it.
    flow.wait("the finished job deleted", lambda: flow.job("rich"), lambda j: j is None)
    flow.wait("its pods gone", lambda: flow.pods("rich"), lambda p: p == [])


def test_suspend_mid_relayout_then_resume_continues_from_the_checkpoint(flow, tmp_path):
    claim, files = shared(flow, "checkpoints")
    # Steps no machine finishes before the suspension: a relayout is planned only for a step
    # the ranks have yet to reach, and at a few steps a second that window of a short job
    # closes while a loaded machine is still on its way to the cordon.
    job = small_job("held", claim, steps=UNFINISHABLE, interval=5)
    _apply(flow, job, tmp_path)
    flow.wait("training past step 12", lambda: max(_losses(flow, "held"), default=0),
              lambda step: step >= 12)
    assert flow.targets("held"), "an NTP-PW job has power targets while it runs"

    # An edit the running pods cannot take is said to wait for the next attempt.
    flow.patch("held", {"steps": UNFINISHABLE + 4})
    pending = flow.wait("UpToDate False", lambda: condition(flow.status("held"), "UpToDate"),
                        lambda c: c.get("status") == "False")
    assert pending["reason"] == "RestartPending" and "spec.steps" in pending["message"]

    # A relayout under way (GPU 1 of node 0 cordoned: its replica to TP 1), then Kueue's
    # suspend: the pods go, and the power targets with them.
    flow.kubectl("annotate", "node", "gpu-node-0", "tessera.dev/cordoned-gpus=1")
    flow.wait("generation 2 published", lambda: flow.status("held"),
              lambda s: s.get("layoutGeneration") == 2)
    flow.patch("held", {"suspend": True})
    status = flow.wait("Suspended", lambda: flow.status("held"),
                       lambda s: s.get("phase") == "Suspended")
    assert condition(status, "Suspended")["status"] == "True"
    flow.wait("no pod left", lambda: flow.pods("held"), lambda p: p == [])
    assert flow.targets("held") == []
    assert status["attempt"] == 1 and status["restarts"] == 0

    # Resumed: a new attempt on the layout as it is now, from the newest checkpoint, to the
    # steps the spec now asks for (a few past that checkpoint, so that the job finishes).
    saved = int(_complete_checkpoints(files / "run")[-1].removeprefix("step-"))
    steps = saved + 8
    flow.patch("held", {"steps": steps})
    reference = _reference(job | {"spec": job["spec"] | {"steps": steps}}, tmp_path)
    flow.patch("held", {"suspend": False})
    pods = flow.wait("the next attempt's trainer pods", lambda: _trainer_pods(flow, "held"),
                     lambda p: len(p) == NODES)
    assert {p["metadata"]["labels"][ATTEMPT_LABEL] for p in pods} == {"1"}
    status = _finished(flow, "held")
    assert condition(status, "Complete")["status"] == "True", status
    assert condition(status, "UpToDate")["status"] == "True"
    assert status["tpLayout"] == "1,2"  # the layout it ended on
    losses = _losses(flow, "held", 1)
    assert saved % 5 == 0 and saved >= 10, saved  # a checkpoint of the interval's
    assert sorted(losses) == list(range(saved + 1, steps + 1))
    assert losses == pytest.approx({s: reference[s] for s in losses}, abs=LOSS_TOLERANCE)
    flow.kubectl("annotate", "node", "gpu-node-0", "tessera.dev/cordoned-gpus-")


def test_a_trainer_pod_killed_is_restarted_from_the_checkpoint(flow, tmp_path):
    claim, _ = shared(flow, "checkpoints")
    job = small_job("crash", claim, steps=STEPS, interval=5)
    job["spec"]["failurePolicy"]["maxRestarts"] = 1
    reference = _reference(job, tmp_path)
    _apply(flow, job, tmp_path)
    flow.wait("training past step 8", lambda: max(_losses(flow, "crash"), default=0),
              lambda step: step >= 8)
    os.kill(_agent_pid("gpu-node-1", "crash"), signal.SIGKILL)  # an OOM kill, say
    killed = time.monotonic()

    status = flow.wait("the restart", lambda: flow.status("crash"),
                       lambda s: s.get("restarts") == 1)
    assert status["attempt"] == 1
    flow.wait("the next attempt training", lambda: _losses(flow, "crash", 1), bool)
    back_s = time.monotonic() - killed
    status = _finished(flow, "crash")
    assert condition(status, "Complete")["status"] == "True", status
    # The downtime is restart badput in the job's goodput.
    earlier = status["earlierAttempts"]
    assert earlier["badputSeconds"]["restart"] > 0 and status["goodput"] < 1
    losses = _losses(flow, "crash", 1)
    resumed = min(losses)
    assert (resumed - 1) % 5 == 0 and resumed > 5, sorted(losses)
    assert sorted(losses) == list(range(resumed, STEPS + 1))
    assert losses == pytest.approx({s: reference[s] for s in losses}, abs=LOSS_TOLERANCE)
    print(f"\ntrainer pod killed -> the next attempt training: {back_s:.1f} s; restart badput "
          f"{earlier['badputSeconds']['restart'] / NODES:.1f} s per node, lost progress "
          f"{earlier['badputSeconds'].get('lost_progress', 0.0) / NODES:.1f} s per node; "
          f"resumed at step {resumed}; job goodput {status['goodput']:.3f}")


def test_pods_a_pod_security_level_refuses_are_a_condition(flow, tmp_path):
    client.CoreV1Api(flow.api).patch_namespace(flow.namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})
    claim, _ = shared(flow, "checkpoints")
    job = small_job("strict", claim, steps=10, interval=5)
    _apply(flow, job, tmp_path)
    ready = flow.wait("Ready False", lambda: condition(flow.status("strict"), "Ready"),
                      lambda c: c.get("reason") == "PodRejected")
    assert "restricted" in ready["message"], ready
    assert flow.pods("strict") == []  # none made: all the job's pods or none
    # What the level asks for, in the template: the pods are made.
    template = job["spec"]["template"]["spec"]
    template["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000,
                                   "seccompProfile": {"type": "RuntimeDefault"}}
    template["containers"][0]["securityContext"] = {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    _apply(flow, job, tmp_path)
    flow.wait("the pods made", lambda: flow.pods("strict"), lambda p: len(p) == NODES + 1)
    flow.kubectl("delete", "ntpjob", "strict", "--wait=true")


def test_a_job_another_controller_manages_is_left_alone(flow, tmp_path):
    claim, _ = shared(flow, "checkpoints")
    theirs = small_job("theirs", claim, steps=10, interval=5)
    theirs["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    _apply(flow, theirs, tmp_path)
    ours = small_job("ours", claim, steps=10, interval=5)
    ours["spec"]["suspend"] = True
    _apply(flow, ours, tmp_path)
    # The operator saw both (it reconciled the later one); it made nothing for the other.
    flow.wait("ours Suspended", lambda: flow.status("ours"),
              lambda s: s.get("phase") == "Suspended")
    left = flow.job("theirs")
    assert left is not None and "status" not in left, left.get("status")
    assert not left["metadata"].get("finalizers")
    assert flow.pods("theirs") == []


def _ended_cleanly(flow: JobFlow, name: str, kind: str) -> dict[str, Any]:
    """The job's final status once it is `kind` (Complete or Failed): conditions that match
    the phase, no pod left running (the rendezvous included), every power target released."""
    status = _finished(flow, name)
    assert condition(status, kind)["status"] == "True", status
    assert status["phase"] == ("Succeeded" if kind == "Complete" else "Failed")
    assert condition(status, "Ready")["status"] == "False"
    assert condition(status, "Ready")["reason"] == "Finished"
    assert condition(status, "Degraded")["reason"] == "NotRunning"
    assert condition(status, "PowerBoosted")["status"] == "False"
    flow.wait("no pod of the job running", lambda: [
        p["metadata"]["name"] for p in flow.pods(name)
        if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")], lambda p: p == [])
    flow.wait("its power targets released", lambda: flow.targets(name), lambda t: t == [])
    return status


@pytest.mark.hardening
def test_a_gpu_returned_in_the_last_steps_ends_the_job_cleanly(flow, tmp_path):
    """The uncordon lands while the last steps train: whether the returned GPU's rank would
    join before or after the end, the job succeeds on the layout it trained, at once."""
    steps = 40
    flow.kubectl("annotate", "node", "gpu-node-0", "tessera.dev/cordoned-gpus=1")
    try:
        claim, _ = shared(flow, "checkpoints")
        job = small_job("ending", claim, steps=steps, interval=1000)
        _apply(flow, job, tmp_path)
        flow.wait("the last steps training", lambda: max(_losses(flow, "ending"), default=0),
                  lambda step: step >= steps - 1)
    finally:
        flow.kubectl("annotate", "node", "gpu-node-0", "tessera.dev/cordoned-gpus-")
    returned = time.monotonic()
    status = _ended_cleanly(flow, "ending", "Complete")
    took = time.monotonic() - returned
    # A joiner nobody meets waited out the rendezvous timeout (600 s) before this held.
    assert took < 30, f"{took:.1f} s from the uncordon to the job's end"
    assert sorted(_losses(flow, "ending")) == list(range(1, steps + 1))  # each step once
    assert status["tpLayout"] in ("1,2", "2,2"), status  # what trained last, either way
    assert status["step"] == steps
    print(f"\nGPU returned {steps - 1}+ of {steps} steps in: the job ended {took:.1f} s later "
          f"on layout {status['tpLayout']}")


@pytest.mark.hardening
def test_a_failed_job_ends_cleanly(flow, tmp_path):
    claim, _ = shared(flow, "checkpoints")
    job = small_job("doomed", claim, steps=STEPS, interval=5)
    job["spec"]["failurePolicy"]["maxRestarts"] = 0
    _apply(flow, job, tmp_path)
    flow.wait("training", lambda: max(_losses(flow, "doomed"), default=0), lambda s: s >= 3)
    os.kill(_agent_pid("gpu-node-1", "doomed"), signal.SIGKILL)
    status = _ended_cleanly(flow, "doomed", "Failed")
    assert condition(status, "Failed")["reason"] == "TrainerFailed"
    assert status["tpLayout"] == "2,2"
