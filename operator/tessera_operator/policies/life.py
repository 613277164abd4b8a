"""The life policy (pure): where a job is in its life, and what an attempt that ends leaves.

The lifecycle (`lifecycle.lifecycle`: running, stopping an ended attempt, suspended, finished)
reads the job's status, pods and its attempt's progress reports. A rank that died again on
its GPU without getting past the step its previous rank there died at (`died_again`: a fault of
the job's, not the GPU's) fails the running attempt as a failed trainer pod does, and so, under
failurePolicy.mode CKPT-RESTART, does a GPU lost under its layout (`_lost_layout`), within the
same restart budget. An ended attempt's layout and
progress ConfigMaps read as absent for the next one (`of_attempt`); its pods on a node that
stopped reporting are deleted at once (`unconfirmable`); a spec field the running pods were not
made with waits for the next attempt (`outdated`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime

from tessera_contracts import progress
from tessera_contracts.generation import layout_configmap
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.powertarget import format_time
from tessera_operator import health, lifecycle, planner, workload
from tessera_operator.lifecycle import Lifecycle, Stage
from tessera_operator.observed import Layout, Observed, Spec
from tessera_operator.policies import signal


def life(spec: Spec, observed: Observed, now: datetime
         ) -> tuple[Lifecycle, dict[planner.GpuId, str]]:
    """The job's lifecycle from its pods and its attempt's progress reports (every node that
    reported: an attempt that ends folds them all into the job's account), and the GPUs lost
    under its layout that end its attempt, with why (CKPT-RESTART; none otherwise). A rank
    that died again (`died_again`), pods that did not start in time (`_gave_up`) or such a
    loss end the running attempt as a failed trainer pod does, within the same restart
    budget (pods that did not start fail the job at once under onPodStartTimeout Fail)."""
    status = observed.job.get("status") or {}
    name = progress.progress_configmap(observed.job["metadata"]["name"])
    current = observed.configmap_attempts.get(name) == int(status.get("attempt", 0))
    reports = observed.reports_of(observed.reports) if current else {}
    found = lifecycle.lifecycle(observed.job, spec.whole, observed.pods, reports, now)
    if found.stage is not Stage.RUNNING:
        return found, {}
    lost: dict[planner.GpuId, str] = {}
    ended = died_again(observed, reports, now) or _gave_up(spec, observed, found.attempt, now)
    run = spec.planning
    if ended is None and isinstance(run, planner.JobSpec) and run.restarts_on_loss:
        lost = _lost_layout(spec, run, of_attempt(observed, found.attempt), now)
        ended = _loss(observed, lost, now) if lost else None
    if ended is None:
        return found, {}
    return lifecycle.lifecycle(observed.job, spec.whole, observed.pods, reports, now,
                               ended_by=ended), lost


def died_again(observed: Observed, reports: Mapping[str, progress.NodeReport | None],
               now: datetime) -> lifecycle.Failure | None:
    """A rank that died again on its GPU after coming back, without getting past the step its
    previous rank there died at (`progress.RankDeath.again`, as its node's agent judged): a
    fault of the job's (a data path, a tokenizer, an exception at a step), not of the GPU,
    which holding the GPU out and letting it back would meet for ever. It ends the attempt
    as a failed trainer pod does: a restart from the checkpoint, within the job's restart
    budget, and with none left the job fails with the rank's last error."""
    for node, report in sorted(reports.items()):
        for index, death in sorted(({} if report is None else report.rank_deaths).items()):
            if not death.again:
                continue
            pod = next((p["metadata"]["name"]
                        for p in workload.trainer_pods(observed.pods, observed.job)
                        if workload.pod_node(p) == node), f"on {node}")
            step = "" if death.step is None else f" at step {death.step}"
            when = datetime.fromtimestamp(min(death.at, now.timestamp()), UTC)
            return lifecycle.Failure(
                f"trainer pod {pod}: the rank on GPU {node}/{index} died again{step} after "
                f"coming back, a fault of the job's rather than the GPU's: {death.error}",
                format_time(when))
    return None


def _lost_layout(spec: Spec, run: planner.JobSpec, observed: Observed, now: datetime
                 ) -> dict[planner.GpuId, str]:
    """CKPT-RESTART: the GPUs whose loss ends the running attempt, with what their health
    source says ("" when it says no more): those of the generation in force that a source
    fails (DCGM, a cordon, a node lost) or whose node's trainer pod is gone; before one is in
    force, the failed GPUs of its nodes once they leave too few whole TP groups for the
    replicas."""
    placement = workload.placed_nodes(observed.pods, observed.job)
    if not placement:
        return {}
    found, _ = signal.health_of(spec.whole, observed, placement, observed.nodes, now)
    in_force = observed.layout.generation
    if in_force is None:
        plan = planner.plan(run, planner.node_domains(observed.nodes, run.domain_label),
                            found.failed)
        return {gpu: found.reasons.get(gpu, "") for gpu in sorted(plan.failed)} \
            if plan.degraded else {}
    used = {(g.node, g.index) for g in in_force.gpus}
    gone = {gpu: "its trainer pod is gone" for gpu in sorted(used)
            if gpu[0] not in placement.values()}
    return gone | {gpu: found.reasons.get(gpu, "") for gpu in sorted(used & found.failed)}


def starting(spec: NTPTrainingJobSpec, observed: Observed, attempt: int
             ) -> lifecycle.Starting:
    """The attempt's pods not started, and when `failurePolicy.podStartTimeoutSeconds` after
    its creation the first of them makes the attempt give up."""
    mine, _ = lifecycle.attempt_pods(observed.pods, attempt)
    found, since = [], []
    for pod in sorted(mine, key=lambda p: p["metadata"]["name"]):
        why = lifecycle.waiting(pod)
        if why is None:
            continue
        found.append((pod["metadata"]["name"], *why))
        created = pod["metadata"].get("creationTimestamp")
        if created:
            since.append(datetime.fromisoformat(str(created)).timestamp())
    timeout = spec.failure_policy.pod_start_timeout_seconds
    return lifecycle.Starting(tuple(found), len(mine), min(since) + timeout if since else None)


def _gave_up(spec: Spec, observed: Observed, attempt: int, now: datetime
             ) -> lifecycle.Failure | None:
    """Pods of the attempt that did not start within `failurePolicy.podStartTimeoutSeconds`
    (unschedulable, an image that cannot be pulled, an init container that never ends): they
    would hold their nodes for ever. The attempt gives up: its pods are deleted, and by
    `onPodStartTimeout` the job restarts (a restart counted, its pods placed anew) or fails."""
    found = starting(spec.whole, observed, attempt)
    if found.gives_up_at is None or now.timestamp() < found.gives_up_at:
        return None
    policy = spec.whole.failure_policy
    pod, reason, message = found.waiting[0]
    restarts = policy.on_pod_start_timeout == "Restart"
    return lifecycle.Failure(
        f"pod {pod} did not start within failurePolicy.podStartTimeoutSeconds "
        f"({policy.pod_start_timeout_seconds} s): {reason}: {message}", format_time(now),
        retries=restarts, reason=None if restarts else "PodStartTimeout")


def _loss(observed: Observed, lost: Mapping[planner.GpuId, str], now: datetime
          ) -> lifecycle.Failure:
    """The failure a GPU `lost` under the layout makes of the attempt (its trainer pod's on
    the first lost GPU's node, the first trainer pod's when that one is gone): without a
    live relayout its ranks cannot go on."""
    (node, index), why = min(lost.items())
    trainers = workload.trainer_pods(observed.pods, observed.job)
    hit = next((p for p in trainers if workload.pod_node(p) == node), trainers[0])
    return lifecycle.Failure(f"trainer pod {hit['metadata']['name']} failed: GPU {node}/{index} "
                             f"lost" + (f": {why}" if why else ""), format_time(now))


def of_attempt(observed: Observed, attempt: int) -> Observed:
    """`observed` without what belongs to an attempt before `attempt`: its layout and progress
    ConfigMaps (deleted by this reconcile) read as absent, and the generation the status says
    was published with them as none."""
    job = observed.job["metadata"]["name"]
    attempts = observed.configmap_attempts
    if attempts.get(layout_configmap(job), attempt) != attempt:
        status = dict(observed.job.get("status") or {}) | {"layoutGeneration": 0}
        observed = replace(observed, layout=Layout(), job=dict(observed.job) | {"status": status})
    if attempts.get(progress.progress_configmap(job), attempt) != attempt:
        observed = replace(observed, reports={})
    return observed


def unconfirmable(observed: Observed) -> tuple[str, ...]:
    """The job's pods being deleted on a node that stopped reporting (Ready Unknown): no kubelet
    will confirm their end, and the next attempt must not wait for one (Kubernetes' own pod
    garbage collector takes those of nodes deleted from the API). Deleting them at once is
    safe for a job: their processes are fenced by the attempt (its own rendezvous and layout),
    and a kubelet that comes back stops what runs for a pod the API no longer has."""
    lost = {n["metadata"]["name"] for n in observed.nodes if health.node_lost(n)}
    return tuple(sorted(
        pod["metadata"]["name"] for pod in observed.pods
        if pod["metadata"].get("deletionTimestamp") and workload.pod_node(pod) in lost))


def outdated(spec: Spec, observed: Observed) -> list[str]:
    """The spec fields some trainer pod of the job was not made with: they take effect at its
    next attempt."""
    found = {name for pod in workload.trainer_pods(observed.pods, observed.job)
             if not (pod.get("metadata") or {}).get("deletionTimestamp")
             for name in workload.outdated(pod, spec.whole)}
    return [name for name in workload.POD_INPUTS if name in found]
