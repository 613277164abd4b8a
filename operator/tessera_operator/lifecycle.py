"""Where a job is in its life (pure): running, suspended, between two attempts, or finished; and
what that asks of its pods.

A job's pods belong to an attempt (their label `tessera.dev/attempt`, the status's `attempt`).
An attempt ends when the job is suspended (`spec.suspend`, as Kueue sets it) or when one of its
trainer pods fails (an exception, an OOM kill, an eviction: not a GPU loss, which the failure
policy absorbs while the pod runs on). Its pods are deleted, its layout and progress ConfigMaps
with them, its power targets released, and what its nodes spent is folded into the status's
`earlierAttempts`, the steps after its last checkpoint as lost progress. The next attempt starts
once no pod of an earlier one is left (pod names are fixed): after a failure at once, as long
as `failurePolicy.maxRestarts` allows, the time without pods counted as restart badput; after a
suspension, at the resume. Its trainers resume from the last checkpoint.

A job is finished when every trainer pod of its attempt succeeded (Complete), or when a failure
finds no restart left (Failed). Its pods still running are deleted, its power targets released,
and `ttlSecondsAfterFinished` later the job itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.powertarget import format_time
from tessera_contracts.progress import Account, NodeReport
from tessera_operator import workload

SUCCEEDED, FAILED = "Succeeded", "Failed"
# A job that finishes in this reconcile is deleted by its TTL no sooner than this: the status
# that records its end is written first.
RECORD_FIRST_S = 1.0


class Stage(StrEnum):
    RUNNING = "Running"  # the attempt's pods are made (or about to be) and train
    STOPPING = "Stopping"  # an earlier attempt's pods are still there: the next one waits
    SUSPENDED = "Suspended"
    FINISHED = "Finished"


@dataclass(frozen=True)
class Finish:
    """How the job ended: the Complete or the Failed condition."""

    succeeded: bool
    reason: str
    message: str
    at: str  # RFC 3339, the condition's lastTransitionTime


@dataclass(frozen=True)
class Lifecycle:
    stage: Stage
    attempt: int
    restarts: int
    earlier: Account
    restarting_since: str | None = None  # a restart under way since then
    finish: Finish | None = None
    ended: bool = False  # an attempt ends in this reconcile: its status is written first
    delete_pods: tuple[str, ...] = ()  # names
    delete_job_in: float | None = None  # seconds until the TTL deletes the job (<= 0: now)
    waiting: str | None = None  # suspended by its queue: why Kueue does not let it run


def attempt_pods(pods: Sequence[Mapping[str, Any]], attempt: int
                 ) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """The pods of `attempt`, and those of earlier attempts (a pod without the label is of the
    job's first)."""
    mine, older = [], []
    for pod in pods:
        (mine if (workload.attempt_of(pod) or 0) == attempt else older).append(pod)
    return mine, older


def lifecycle(job: Mapping[str, Any], spec: NTPTrainingJobSpec,
              pods: Sequence[Mapping[str, Any]], reports: Mapping[str, NodeReport | None],
              now: datetime, ended_by: Failure | None = None) -> Lifecycle:
    """Where `job` (its spec typed: `spec`) is, given the pods it controls and its attempt's
    progress reports; `ended_by`: a failure of the running attempt that its pods do not show
    (the life policy's: a GPU of its layout lost, a rank that died again, pods that never
    started), which ends it as a failed trainer pod does."""
    status = job.get("status") or {}
    attempt, restarts = int(status.get("attempt", 0)), int(status.get("restarts", 0))
    earlier = Account.from_status(status.get("earlierAttempts"))
    since = status.get("restartingSince")
    mine, older = attempt_pods(pods, attempt)
    finish = finished(status)
    if finish is None:
        failed, done = outcome(workload.trainer_pods(mine, job))
        failed = failed or ended_by
        budget = spec.failure_policy.max_restarts if failed is None or failed.retries else 0
        if failed is not None and restarts < budget:
            # The restart's downtime counts from the failure: the attempt's reports end at
            # their last write, and the failed node's agent wrote none after.
            spent = Account.of_attempt(reports, resumes_at(spec, reports))
            return Lifecycle(Stage.STOPPING, attempt + 1, restarts + 1, earlier.plus(spent),
                             failed.at or format_time(now), ended=True,
                             delete_pods=_live(pods))
        if failed is not None:
            reason = failed.reason or ("RestartLimitReached" if budget else "TrainerFailed")
            more = f" after {restarts} restart(s), failurePolicy.maxRestarts {budget}" \
                if budget else ""
            finish = Finish(False, reason, failed.message + more, format_time(now))
        elif done:
            finish = Finish(True, "StepsDone", "every trainer pod finished the job's steps",
                            format_time(now))
    if finish is not None:
        ttl = spec.ttl_seconds_after_finished
        due = None if ttl is None else (
            datetime.fromisoformat(finish.at).timestamp() + ttl - now.timestamp())
        if due is not None and finished(status) is None:
            due = max(due, RECORD_FIRST_S)  # the job is deleted only once its end is recorded
        return Lifecycle(Stage.FINISHED, attempt, restarts, earlier, finish=finish,
                         delete_pods=_live(pods, running_only=True), delete_job_in=due)
    if spec.suspend:
        if since is not None:
            # a restart under way: its time up to now was restart badput, the rest is not
            earlier = earlier.plus(_gap(spec, since, now))
        if _live(mine):
            spent = Account.of_attempt(reports, resumes_at(spec, reports))
            return Lifecycle(Stage.SUSPENDED, attempt + 1, restarts, earlier.plus(spent),
                             ended=True, delete_pods=_live(pods))
        return Lifecycle(Stage.SUSPENDED, attempt, restarts, earlier, delete_pods=_live(older),
                         ended=since is not None)
    if older:
        return Lifecycle(Stage.STOPPING, attempt, restarts, earlier, since,
                         delete_pods=_live(older))
    if since is not None and not mine:
        # The attempt's pods are made now: the time since the failed one stopped is restart
        # badput on each of the job's nodes.
        return Lifecycle(Stage.RUNNING, attempt, restarts, earlier.plus(_gap(spec, since, now)))
    return Lifecycle(Stage.RUNNING, attempt, restarts, earlier, since)


def _gap(spec: NTPTrainingJobSpec, since: str, now: datetime) -> Account:
    return Account.restart_gap((now - datetime.fromisoformat(since)).total_seconds(),
                               spec.trainers)


def resumes_at(spec: NTPTrainingJobSpec, reports: Mapping[str, NodeReport | None]) -> int:
    """The step the next attempt resumes at: the last checkpoint the trainers wrote (every
    intervalSteps), or the start without a checkpoint path."""
    checkpoint = spec.checkpoint_policy
    if not checkpoint.path:
        return 0
    step = min((r.step for r in reports.values() if r is not None), default=0)
    return step // checkpoint.interval_steps * checkpoint.interval_steps


def finished(status: Mapping[str, Any]) -> Finish | None:
    """How the job ended, as its status says; None while it has not."""
    for c in status.get("conditions") or []:
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            return Finish(c["type"] == "Complete", str(c.get("reason", "")),
                          str(c.get("message", "")), str(c.get("lastTransitionTime", "")))
    return None


@dataclass(frozen=True)
class Failure:
    """What ended an attempt: the first trainer pod that failed, or a failure the life policy
    found. `retries`: whether the job's restart budget may restart it (else it fails the job,
    for `reason`)."""

    message: str
    at: str | None  # when it failed (RFC 3339; a container's end, when the kubelet says)
    retries: bool = True
    reason: str | None = None  # the Failed condition's; None: by the restart budget


def outcome(trainer_pods: Sequence[Mapping[str, Any]]) -> tuple[Failure | None, bool]:
    """The first failed trainer pod (None: none did), and whether all succeeded."""
    for pod in trainer_pods:
        status = pod.get("status") or {}
        if status.get("phase") == FAILED:
            why = next((s["state"]["terminated"] for s in status.get("containerStatuses") or []
                        if (s.get("state") or {}).get("terminated")), {})
            reason = why.get("reason") or status.get("reason") or "Error"
            return Failure(f"trainer pod {pod['metadata']['name']} failed: {reason} (exit code "
                           f"{why.get('exitCode', '?')})", why.get("finishedAt")), False
    done = bool(trainer_pods) and all((p.get("status") or {}).get("phase") == SUCCEEDED
                                      for p in trainer_pods)
    return None, done


@dataclass(frozen=True)
class Starting:
    """The running attempt's pods that have not started (`waiting`), each with why (pod,
    reason, message, by name), of its `pods` in all, and when the attempt gives up on the
    first of them (Unix seconds; None: none waits)."""

    waiting: tuple[tuple[str, str, str], ...] = ()
    pods: int = 0
    gives_up_at: float | None = None


# Waiting reasons of a container on its way to start: no more than that it is not started yet.
_STARTING = ("ContainerCreating", "PodInitializing")


def waiting(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why `pod` has not started, as the scheduler and the kubelet say (a reason and a
    message): not scheduled, an init container waiting or still running, a container waiting
    (its image not pulled, its configuration missing); None once it runs or ended, or while it
    is being deleted."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Running", SUCCEEDED, FAILED) \
            or pod["metadata"].get("deletionTimestamp"):
        return None
    scheduled = next((c for c in status.get("conditions") or []
                      if c.get("type") == "PodScheduled"), {})
    if scheduled.get("status") == "False":
        return scheduled.get("reason") or "Unschedulable", scheduled.get("message") or ""
    if not scheduled:
        return "Pending", "not scheduled yet"
    for kind, statuses in (("init container", status.get("initContainerStatuses")),
                           ("container", status.get("containerStatuses"))):
        for container in statuses or []:
            state = container.get("state") or {}
            where = f"{kind} {container.get('name', '?')}"
            if (held := state.get("waiting")) and held.get("reason") not in _STARTING:
                return str(held.get("reason") or "Waiting"), \
                    f"{where}: {held.get('message') or 'waiting'}"
            if kind == "init container" and "running" in state:
                return "InitContainerRunning", \
                    f"{where} running since {state['running'].get('startedAt', '?')}"
    return "ContainerCreating", "its containers are being created"


def _live(pods: Sequence[Mapping[str, Any]], running_only: bool = False) -> tuple[str, ...]:
    """The names of `pods` not being deleted already (with `running_only`, nor ended)."""
    return tuple(p["metadata"]["name"] for p in pods
                 if not p["metadata"].get("deletionTimestamp")
                 and not (running_only and (p.get("status") or {}).get("phase")
                          in (SUCCEEDED, FAILED)))
