"""Where a job is in its life (pure): from its status, its pods and its attempt's progress reports,
whether it runs, restarts after a failed trainer pod, is suspended or finished; which pods go;
and what its ended attempts spent, carried in its account."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from tessera_contracts.api import ATTEMPT_LABEL, JOB_LABEL, ROLE_LABEL
from tessera_contracts.jobspec import NTPTrainingJobSpec, defaulted
from tessera_contracts.powertarget import format_time
from tessera_contracts.progress import Account, NodeReport, State
from tessera_dev import paths
from tessera_operator.lifecycle import RECORD_FIRST_S, Finish, Lifecycle, Stage, lifecycle

pytestmark = pytest.mark.operator

NOW = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
AT = format_time(NOW)
EXAMPLE = yaml.safe_load(
    (paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())
CHECKPOINTS = {"path": "/checkpoints/llama", "intervalSteps": 500}


def _job(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """The example job (two trainer pods: 16 GPUs, 8 a node), a checkpoint every 500 steps, as
    the API server stores it (the CRD's defaults filled in)."""
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1}
    job["spec"] = defaulted(job["spec"] | {"checkpointPolicy": CHECKPOINTS} | spec)
    return job | ({"status": status} if status is not None else {})


def _spec(job: dict[str, Any]) -> NTPTrainingJobSpec:
    return NTPTrainingJobSpec.from_spec(job["spec"])


def _restarts(budget: int) -> dict[str, Any]:
    return EXAMPLE["spec"]["failurePolicy"] | {"maxRestarts": budget}


def _pod(name: str, attempt: int | None = 0, phase: str = "Running", deleting: bool = False,
         terminated: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pod of the job, as the API lists it: `name` is `rendezvous` or `node-<i>`; `attempt`
    None for one without the label."""
    role = "rendezvous" if name == "rendezvous" else "trainer"
    labels = {JOB_LABEL: "llama", ROLE_LABEL: role} | (
        {} if attempt is None else {ATTEMPT_LABEL: str(attempt)})
    meta: dict[str, Any] = {
        "name": f"llama-{name}", "namespace": "ml", "labels": labels,
        "ownerReferences": [{"apiVersion": "tessera.dev/v1alpha1", "kind": "NTPTrainingJob",
                             "name": "llama", "uid": "uid-1", "controller": True}]}
    if deleting:
        meta["deletionTimestamp"] = format_time(NOW - timedelta(seconds=5))
    status: dict[str, Any] = {"phase": phase}
    if terminated is not None:
        status["containerStatuses"] = [{"name": "trainer",
                                        "state": {"terminated": terminated}}]
    return {"metadata": meta, "status": status}


OOM = {"reason": "OOMKilled", "exitCode": 137}


def _running(attempt: int = 0) -> list[dict[str, Any]]:
    return [_pod("rendezvous", attempt), _pod("node-0", attempt), _pod("node-1", attempt)]


def _failed(attempt: int = 0) -> list[dict[str, Any]]:
    """node-1's trainer killed for memory, the rest running."""
    return [_pod("rendezvous", attempt), _pod("node-0", attempt),
            _pod("node-1", attempt, "Failed", terminated=OOM)]


EVERY_POD = ("llama-rendezvous", "llama-node-0", "llama-node-1")

# What the job's earlier attempts spent, as its status carries it.
PRIOR = Account(1000.0, 700.0, {"restart": 300.0})

# The attempt's reports. Its last checkpoint is at step 1000 (the lowest step, 1234, rounded
# down to the 500-step interval), so the steps after it are done again.
REPORTS = {
    "gpu-a": NodeReport("gpu-a", 1, 1234, 5000, State.TRAINING, step_seconds=2.0,
                        productive_seconds=3000.0, wall_seconds=3600.0,
                        badput_seconds={"startup": 400.0, "checkpoint_save": 200.0}),
    "gpu-b": NodeReport("gpu-b", 1, 1240, 5000, State.TRAINING, step_seconds=2.5,
                        productive_seconds=3100.0, wall_seconds=3600.0,
                        badput_seconds={"startup": 420.0, "reconfiguration": 80.0}),
    "gpu-c": None,  # no report: it spent nothing the account can count
}
# By hand: gpu-a redoes 1234 - 1000 = 234 steps at 2.0 s = 468 s, gpu-b 1240 - 1000 = 240
# steps at 2.5 s = 600 s; that productive time moves to lost progress.
# wall 1000 + 3600 + 3600 = 8200; productive 700 + (3000 - 468) + (3100 - 600) = 5732;
# lost progress 468 + 600 = 1068; 5732 + 300 + 820 + 200 + 80 + 1068 = 8200.
SPENT = Account(8200.0, 5732.0, {"restart": 300.0, "startup": 820.0, "checkpoint_save": 200.0,
                                 "reconfiguration": 80.0, "lost_progress": 1068.0})


def _status(attempt: int = 0, restarts: int = 0, **more: Any) -> dict[str, Any]:
    return {"attempt": attempt, "restarts": restarts,
            "earlierAttempts": PRIOR.to_status()} | more


def _finished(kind: str, at: datetime) -> dict[str, Any]:
    return {"type": kind, "status": "True", "reason": "StepsDone" if kind == "Complete"
            else "TrainerFailed", "message": "as it ended", "lastTransitionTime": format_time(at)}


@dataclass(frozen=True)
class Case:
    job: dict[str, Any]
    pods: list[dict[str, Any]]
    expected: Lifecycle
    reports: dict[str, NodeReport | None] = field(default_factory=dict)


CASES = {
    "every pod running: the attempt runs on": Case(
        _job(_status()), _running(), Lifecycle(Stage.RUNNING, 0, 0, PRIOR), REPORTS),
    "a trainer pod failed, restarts left: the attempt ends, its account folded in": Case(
        _job(_status(), failurePolicy=_restarts(3)), _failed(),
        Lifecycle(Stage.STOPPING, 1, 1, SPENT, AT, ended=True, delete_pods=EVERY_POD),
        REPORTS),
    "a failure the kubelet timed: the restart's downtime counts from it": Case(
        _job(_status(), failurePolicy=_restarts(3)),
        [*_failed()[:2], _pod("node-1", 0, "Failed", terminated=OOM | {
            "finishedAt": "2026-01-01T00:00:00Z"})],
        Lifecycle(Stage.STOPPING, 1, 1, SPENT, "2026-01-01T00:00:00Z", ended=True,
                  delete_pods=EVERY_POD), REPORTS),
    "the third failure of three restarts: still a restart": Case(
        _job(_status(2, 2), failurePolicy=_restarts(3)), _failed(2),
        Lifecycle(Stage.STOPPING, 3, 3, SPENT, AT, ended=True, delete_pods=EVERY_POD),
        REPORTS),
    "a failure with a pod already going: the others are deleted": Case(
        _job(_status(), failurePolicy=_restarts(3)),
        [_pod("rendezvous", deleting=True), *_failed()[1:]],
        Lifecycle(Stage.STOPPING, 1, 1, SPENT, AT, ended=True,
                  delete_pods=("llama-node-0", "llama-node-1")), REPORTS),
    # Resumed from step 0: gpu-a redoes 1234 steps at 2.0 s = 2468 s of its 3000 productive,
    # gpu-b 1240 at 2.5 s = 3100 s, all of its 3100.
    "a failure without a checkpoint path: every step is done again": Case(
        _job(_status(), failurePolicy=_restarts(3), checkpointPolicy={"intervalSteps": 500}),
        _failed(),
        Lifecycle(Stage.STOPPING, 1, 1, Account(
            8200.0, 1232.0, {"restart": 300.0, "startup": 820.0, "checkpoint_save": 200.0,
                             "reconfiguration": 80.0, "lost_progress": 5568.0}),
            AT, ended=True, delete_pods=EVERY_POD), REPORTS),
    "a failure with no restart left: Failed, the running pods deleted": Case(
        _job(_status(3, 3), failurePolicy=_restarts(3)), _failed(3),
        Lifecycle(Stage.FINISHED, 3, 3, PRIOR, finish=Finish(
            False, "RestartLimitReached",
            "trainer pod llama-node-1 failed: OOMKilled (exit code 137) after 3 restart(s), "
            "failurePolicy.maxRestarts 3", AT),
            delete_pods=("llama-rendezvous", "llama-node-0")), REPORTS),
    "a failure where maxRestarts is 0: Failed at once": Case(
        _job(_status(), failurePolicy=_restarts(0)),
        [_pod("rendezvous"), _pod("node-0", phase="Failed"), _pod("node-1")],
        Lifecycle(Stage.FINISHED, 0, 0, PRIOR, finish=Finish(
            False, "TrainerFailed", "trainer pod llama-node-0 failed: Error (exit code ?)", AT),
            delete_pods=("llama-rendezvous", "llama-node-1")), REPORTS),
    "every trainer pod succeeded: Complete, the rendezvous deleted": Case(
        _job(_status()),
        [_pod("rendezvous"), _pod("node-0", phase="Succeeded"),
         _pod("node-1", phase="Succeeded")],
        Lifecycle(Stage.FINISHED, 0, 0, PRIOR, finish=Finish(
            True, "StepsDone", "every trainer pod finished the job's steps", AT),
            delete_pods=("llama-rendezvous",)), REPORTS),
    "one trainer pod succeeded, the other still running: running": Case(
        _job(_status()), [_pod("rendezvous"), _pod("node-0", phase="Succeeded"),
                          _pod("node-1")],
        Lifecycle(Stage.RUNNING, 0, 0, PRIOR), REPORTS),
    "Complete 100 s ago, a TTL of 600 s: deleted in 500 s": Case(
        _job(_status(conditions=[_finished("Complete", NOW - timedelta(seconds=100))]),
             ttlSecondsAfterFinished=600), [],
        Lifecycle(Stage.FINISHED, 0, 0, PRIOR, finish=Finish(
            True, "StepsDone", "as it ended", format_time(NOW - timedelta(seconds=100))),
            delete_job_in=500.0)),
    "Failed 700 s ago, a TTL of 600 s: deleted now": Case(
        _job(_status(conditions=[_finished("Failed", NOW - timedelta(seconds=700))]),
             ttlSecondsAfterFinished=600), [],
        Lifecycle(Stage.FINISHED, 0, 0, PRIOR, finish=Finish(
            False, "TrainerFailed", "as it ended", format_time(NOW - timedelta(seconds=700))),
            delete_job_in=-100.0)),
    "finished without a TTL: kept, a pod still running deleted": Case(
        _job(_status(conditions=[_finished("Complete", NOW - timedelta(days=3))])),
        [_pod("rendezvous"), _pod("node-0", phase="Succeeded")],
        Lifecycle(Stage.FINISHED, 0, 0, PRIOR, finish=Finish(
            True, "StepsDone", "as it ended", format_time(NOW - timedelta(days=3))),
            delete_pods=("llama-rendezvous",))),
    "finishing now with a TTL of 0: deleted once its end is recorded": Case(
        _job(_status(), ttlSecondsAfterFinished=0),
        [_pod("node-0", phase="Succeeded"), _pod("node-1", phase="Succeeded")],
        Lifecycle(Stage.FINISHED, 0, 0, PRIOR, finish=Finish(
            True, "StepsDone", "every trainer pod finished the job's steps", AT),
            delete_job_in=RECORD_FIRST_S)),
    "suspended while running: the attempt ends, no restart counted": Case(
        _job(_status(0, 1), suspend=True), _running(),
        Lifecycle(Stage.SUSPENDED, 1, 1, SPENT, ended=True, delete_pods=EVERY_POD), REPORTS),
    "suspended, no pod: it stays so": Case(
        _job(_status(1, 1), suspend=True), [], Lifecycle(Stage.SUSPENDED, 1, 1, PRIOR)),
    "suspended, the ended attempt's pods still going: nothing more to delete": Case(
        _job(_status(1, 1), suspend=True), [_pod("node-0", 0, deleting=True)],
        Lifecycle(Stage.SUSPENDED, 1, 1, PRIOR)),
    "pods of the failed attempt left: stopping, they are deleted": Case(
        _job(_status(1, 1, restartingSince=format_time(NOW - timedelta(seconds=30))),
             failurePolicy=_restarts(3)),
        [_pod("rendezvous", None), _pod("node-0", 0, deleting=True),
         _pod("node-1", 0, "Failed", terminated=OOM)],
        Lifecycle(Stage.STOPPING, 1, 1, PRIOR, format_time(NOW - timedelta(seconds=30)),
                  delete_pods=("llama-rendezvous", "llama-node-1"))),
    "resumed with the suspended attempt's pods left: stopping, no restart": Case(
        _job(_status(1, 0)), [_pod("node-0", 0, deleting=True), _pod("node-1", 0)],
        Lifecycle(Stage.STOPPING, 1, 0, PRIOR, delete_pods=("llama-node-1",))),
    "the failed attempt's pods gone: the gap on each node is restart badput": Case(
        _job(_status(1, 1, restartingSince=format_time(NOW - timedelta(seconds=90))),
             failurePolicy=_restarts(3)), [],
        # 90 s without pods on each of the job's 2 nodes
        Lifecycle(Stage.RUNNING, 1, 1, Account(1180.0, 700.0, {"restart": 480.0}))),
    "the next attempt's pods made: running, the gap counted once": Case(
        _job(_status(1, 1)), _running(1), Lifecycle(Stage.RUNNING, 1, 1, PRIOR)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_where_a_job_is_in_its_life(case: Case) -> None:
    assert lifecycle(case.job, _spec(case.job), case.pods, case.reports, NOW) == case.expected


def test_a_job_whose_status_says_nothing_is_on_its_first_attempt() -> None:
    assert lifecycle(_job(), _spec(_job()), [], {}, NOW) == Lifecycle(
        Stage.RUNNING, 0, 0, Account())
    suspended = _job(suspend=True)
    assert lifecycle(suspended, _spec(suspended), [], {}, NOW) == Lifecycle(
        Stage.SUSPENDED, 0, 0, Account())
