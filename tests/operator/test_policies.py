"""Each of the operator's policies on its own (pure, no API server): a job's typed spec and a world
observed by hand in, its part of the decision out: its life, its placement, its GPUs' health
signal, the generation document it publishes, its power."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from tessera_contracts import gpuhealth, progress
from tessera_contracts.generation import LAYOUT_KEY, Generation, Gpu, Rendezvous, next_generation
from tessera_contracts.jobspec import defaulted
from tessera_contracts.powertarget import to_object
from tessera_contracts.progress import NodeReport, RankDeath, State
from tessera_contracts.unreadable import Unreadable
from tessera_dev import paths
from tessera_operator import desired, health, planner, workload
from tessera_operator.lifecycle import Stage
from tessera_operator.observed import Candidates, Layout, Observed, Spec
from tessera_operator.policies import life, placement, power, publish, signal

pytestmark = pytest.mark.operator

NOW = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
A, B, C = "gpu-a", "gpu-b", "gpu-c"
IP = "10.0.0.5"
POOL = {"pool.tessera.dev/name": "llama"}
# TP8 x DP2 on two 8-GPU nodes, NTP-PW: each node its own scale-up domain (rack).
EXAMPLE = yaml.safe_load(
    (paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())
POWER = EXAMPLE["spec"]["powerPolicy"]
BASE, CAP, BUDGET = POWER["baseCapWatts"], POWER["boostCapWatts"], POWER["rackBudgetWatts"]


def _job(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """The example job on the pool's nodes, as the API server stores it."""
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1}
    job["spec"]["template"]["spec"]["nodeSelector"] = dict(POOL)
    job["spec"] = defaulted(job["spec"] | spec)
    return job | ({"status": status} if status is not None else {})


def _spec(job: dict[str, Any]) -> Spec:
    read_spec = desired.job_spec(job)
    assert isinstance(read_spec, Spec), read_spec
    return read_spec


def _run(spec: Spec) -> planner.JobSpec:
    assert isinstance(spec.planning, planner.JobSpec), spec.planning
    return spec.planning


def _mode(mode: str) -> dict[str, Any]:
    return {"failurePolicy": EXAMPLE["spec"]["failurePolicy"] | {"mode": mode}}


def _node(name: str, cordon: str | None = None, pool: dict[str, str] = POOL) -> dict[str, Any]:
    annotations = {} if cordon is None else {"tessera.dev/cordoned-gpus": cordon}
    return {"metadata": {"name": name, "labels": dict(pool), "annotations": annotations},
            "spec": {}, "status": {"allocatable": {workload.GPU_RESOURCE: "8"},
                                   "conditions": [{"type": "Ready", "status": "True"}]}}


def _pods(job: dict[str, Any], ip: str | None = IP) -> tuple[dict[str, Any], ...]:
    """The job's pods as the operator makes them, on A and B."""
    spec = _spec(job).whole
    rendezvous = workload.rendezvous_pod(job, spec) | {"status": {"podIP": ip} if ip else {}}
    return (rendezvous, workload.trainer_pod(job, spec, 0, A),
            workload.trainer_pod(job, spec, 1, B))


def _gpu_health(node: str, xids: dict[int, list[int]], at: datetime = NOW
                ) -> gpuhealth.PublishedHealth | Unreadable:
    """The node's GPUHealth as its health agent publishes it and the operator's index holds it:
    every GPU healthy, with the recent `xids` given."""
    gpus = tuple(gpuhealth.GpuHealth(i, gpuhealth.State.HEALTHY, xids=tuple(xids.get(i, ())))
                 for i in range(8))
    return gpuhealth.read(gpuhealth.render(gpuhealth.PublishedHealth(
        node, "http://10.0.0.1:9400/metrics", at.timestamp(), gpuhealth.NodeHealth(gpus))))


def _first_generation(job: dict[str, Any]) -> Generation:
    """Generation 1 of `job` on A and B, every GPU healthy."""
    plan = planner.plan(_run(_spec(job)), {A: A, B: B}, set())
    first = workload.generation_for(plan, 64, Rendezvous(IP, workload.RENDEZVOUS_PORT), None)
    assert first is not None
    return first


def _in_force(job: dict[str, Any], **world: Any) -> Observed:
    """`job`'s attempt 0 on A and B with generation 1 in force and published."""
    published = job | {"status": {"layoutGeneration": 1}}
    return replace(Observed(published, pods=_pods(job), nodes=(_node(A), _node(B)),
                            layout=Layout("7", generation=_first_generation(job)),
                            configmap_attempts={"llama-layout": 0, "llama-progress": 0}),
                   **world)


# ----------------------------------------------------------------------------------------------
# life
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "stage", "lost"), [
    ("CKPT-RESTART", Stage.STOPPING, {(A, 3): ""}),
    ("NTP", Stage.RUNNING, {}),
])
def test_life_a_gpu_lost_under_the_layout_ends_the_attempt_only_under_ckpt_restart(
        mode: str, stage: Stage, lost: dict[tuple[str, int], str]) -> None:
    job = _job(**_mode(mode))
    cordoned = _in_force(job, nodes=(_node(A, cordon="3"), _node(B)))
    found, why = life.life(_spec(job), cordoned, NOW)
    assert (found.stage, why) == (stage, lost)
    assert found.restarts == (1 if stage is Stage.STOPPING else 0)


def test_life_an_earlier_attempts_configmaps_read_as_absent() -> None:
    job = _job()
    earlier = replace(_in_force(job), configmap_attempts={"llama-layout": 0, "llama-progress": 1},
                      reports={A: NodeReport(A, 1, 5, 1000, State.TRAINING)})
    current = life.of_attempt(earlier, 1)
    assert current.layout == Layout() and current.job["status"]["layoutGeneration"] == 0
    assert current.reports == earlier.reports  # the progress ConfigMap is attempt 1's
    assert life.of_attempt(earlier, 0).reports == {}


# ----------------------------------------------------------------------------------------------
# placement
# ----------------------------------------------------------------------------------------------


def test_placement_takes_whole_free_nodes_of_the_pool_and_names_what_the_job_runs() -> None:
    job = _job()
    spec = _spec(job)
    other = {"metadata": {"name": "theirs"}, "spec": {"nodeName": B, "containers": [
        {"resources": {"limits": {workload.GPU_RESOURCE: "1"}}}]}, "status": {"phase": "Running"}}
    candidates = Candidates((_node(A), _node(B), _node(C), _node("gpu-d", pool={})),
                            workload.taken_gpus([other]))
    fresh = Observed(job, candidates=candidates)
    assert placement.needs_placement(spec, fresh, NOW)
    assert placement.chosen_nodes(spec, fresh) == (A, C)
    placed = placement.place(spec.whole, _run(spec), fresh, NOW)
    assert not isinstance(placed, planner.Problem)
    assert placed[0] == {0: A, 1: C}
    made = placement.children(job, spec.whole, placed[0], 0)
    assert [(c["kind"], c["metadata"]["name"]) for c in made] == [
        ("ServiceAccount", "llama-trainer"), ("Role", "llama-trainer"),
        ("RoleBinding", "llama-trainer"), ("ConfigMap", "llama-progress"),
        ("Pod", "llama-rendezvous"), ("Pod", "llama-node-0"), ("Pod", "llama-node-1")]
    # placed, it needs nothing more
    assert not placement.needs_placement(spec, Observed(job, pods=_pods(job)), NOW)


def test_placement_under_ckpt_restart_skips_a_node_with_a_failed_gpu() -> None:
    job = _job(**_mode("CKPT-RESTART"))
    spec = _spec(job)
    fresh = Observed(job, candidates=Candidates((_node(A, cordon="1"), _node(B), _node(C))))
    placed = placement.place(spec.whole, _run(spec), fresh, NOW)
    assert not isinstance(placed, planner.Problem) and placed[0] == {0: B, 1: C}
    alone = Observed(job, candidates=Candidates((_node(A, cordon="1"),)))
    refused = placement.place(spec.whole, _run(spec), alone, NOW)
    assert isinstance(refused, planner.Problem) and refused.reason == "Unschedulable"
    assert "CKPT-RESTART" in refused.message


# ----------------------------------------------------------------------------------------------
# signal
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sources", "failed"), [
    (["dcgm", "cordon"], {(A, 0), (B, 5)}),
    (["cordon"], {(A, 0)}),
    (["dcgm"], {(B, 5)}),
])
def test_signal_reads_the_health_sources_the_spec_names(
        sources: list[str], failed: set[tuple[str, int]]) -> None:
    job = _job(failurePolicy=EXAMPLE["spec"]["failurePolicy"] | {"healthSources": sources})
    observed = _in_force(job, nodes=(_node(A, cordon="0"), _node(B)),
                         gpu_health=(_gpu_health(A, {}), _gpu_health(B, {5: [79]})))
    found, lost = signal.health_of(_spec(job).whole, observed, {0: A, 1: B}, observed.nodes,
                                   NOW)
    assert found.failed == failed
    assert lost.failed == ({(B, 5)} if "dcgm" in sources else set())  # a cordon drains


def test_signal_judges_xids_and_dead_ranks_by_the_jobs_failure_policy() -> None:
    """fatalXIDs decides which XIDs fail a GPU; a rank that died after DCGM last spoke keeps
    its GPU out for rankDeathHoldSeconds, when the job asks to be reconciled again."""
    died = NOW.timestamp() - 1.0
    dead = NodeReport(A, 1, 118, 1000, State.RECONFIGURING, rank_deaths={2: died})
    before = datetime.fromtimestamp(died - 30, UTC)
    for fatal, hold in (([48], 10), ([], 30)):
        job = _job(failurePolicy=EXAMPLE["spec"]["failurePolicy"] | {
            "fatalXIDs": fatal, "rankDeathHoldSeconds": hold})
        observed = _in_force(job, reports={A: dead}, gpu_health=(
            _gpu_health(A, {}, before), _gpu_health(B, {6: [48]}, before)))
        found, _ = signal.health_of(_spec(job).whole, observed, {0: A, 1: B}, observed.nodes,
                                    NOW)
        assert found.failed == {(A, 2)} | ({(B, 6)} if 48 in fatal else set())
        assert found.recheck_at == died + hold


# ----------------------------------------------------------------------------------------------
# publish
# ----------------------------------------------------------------------------------------------


def _published(job: dict[str, Any], observed: Observed
               ) -> tuple[dict[str, Any] | None, Generation | None]:
    spec = _spec(job)
    plan = planner.plan(_run(spec), {A: A, B: B}, set())
    return publish.to_publish(spec.whole, observed, plan, {}, frozenset(), NOW, spec.whole.steps)


def test_publish_generation_1_once_the_rendezvous_has_an_address() -> None:
    job = _job()
    waiting = Observed(job, pods=_pods(job, ip=None), nodes=(_node(A), _node(B)))
    assert _published(job, waiting) == (None, None)
    document, in_force = _published(job, replace(waiting, pods=_pods(job)))
    assert in_force is not None and in_force.generation == 1 and in_force.at_step is None
    assert document == publish.layout_document(job, in_force)
    # once in force, the same plan publishes nothing new
    assert _published(job, _in_force(job)) == (None, _in_force(job).layout.generation)


@pytest.mark.parametrize(("layout", "reason"), [
    (Layout("3", owned=False), "LayoutNotOwned"),
    (Layout(), "LayoutLost"),  # the status says generation 1 was published
])
def test_publish_is_blocked_by_a_layout_it_may_not_follow(layout: Layout, reason: str) -> None:
    job = _job()
    with pytest.raises(publish.LayoutBlocked) as blocked:
        _published(job, _in_force(job, layout=layout))
    assert blocked.value.reason == reason


def test_publish_counts_only_the_reports_that_agree_with_the_pods() -> None:
    honest = NodeReport(A, 1, 118, 1000, State.TRAINING)
    other_job = NodeReport(B, 1, 5, 2000, State.TRAINING)
    short = NodeReport(B, 1, 500, 1000, State.FINISHED)
    for forged in (other_job, short):
        kept, refused = publish.agreed({A: honest, B: forged}, 1000)
        assert kept == {A: honest, B: None} and len(refused) == 1 and B in refused[0]
    assert publish.agreed({A: honest, B: other_job}, None) == ({A: honest, B: other_job}, ())


# ----------------------------------------------------------------------------------------------
# power
# ----------------------------------------------------------------------------------------------


def test_power_boosts_a_reduced_replica_inside_its_rack_and_syncs_in_one_pass() -> None:
    job = _job()
    plan = planner.plan(_run(_spec(job)), {A: A, B: B}, {(A, 3)})
    at_base = planner.plan(_run(_spec(job)), {A: A, B: B}, set()).power_targets()
    observed = _in_force(job, targets=tuple(to_object(t) for t in at_base.values()))
    boosted, targets = power.boosted(plan, observed, {}, frozenset())
    watts = {i: targets[A].watts_for(i) for i in range(8)}
    assert watts[3] == 200 and sum(watts.values()) <= BUDGET
    assert {w for i, w in watts.items() if i != 3} == {min(CAP, (BUDGET - 200) // 7)}
    assert {targets[B].watts_for(i) for i in range(8)} == {BASE}
    # Each rack is one node: its new share is written at once, nothing waits; B is unchanged.
    sync = power.sync(observed, targets)
    assert sync.write == {A: targets[A]} and sync.delete == () and sync.held == ()
    assert power.sync(observed, {}).delete == (A, B)  # no plan: every target released


def test_power_goes_on_from_the_boost_the_status_remembers() -> None:
    """The closed loop's state is in status.replicas: a restarted operator resumes each reduced
    replica's ratio there, not from the open-loop seed."""
    job = _job()
    plan = planner.plan(_run(_spec(job)), {A: A, B: B}, {(A, 3)})
    (reduced,) = [r for r in plan.replicas if r.tp < 8]
    remembered = {"index": reduced.index, "tensorParallelSize": reduced.tp,
                  "nodes": list(reduced.nodes()), "failedGPUs": [f"{A}/3"],
                  "powerRatio": 1.1, "powerRatioStep": 100}
    observed = _in_force(job)
    seeded, _ = power.boosted(plan, observed, {}, frozenset())
    observed = replace(observed, job=observed.job | {"status": {"layoutGeneration": 1,
                                                                "replicas": [remembered]}})
    resumed, _ = power.boosted(plan, observed, {}, frozenset())
    ratio = {r.index: (r.power_ratio, r.ratio_step) for r in resumed.replicas}
    assert ratio[reduced.index] == (1.1, 100)
    assert dict((r.index, r.power_ratio) for r in seeded.replicas)[reduced.index] != 1.1


# ----------------------------------------------------------------------------------------------
# hardening: what one trainer pod's own report may not decide
# ----------------------------------------------------------------------------------------------


def _report(node: str, at: float, **fields: Any) -> NodeReport:
    """A training node's report written at `at` (Unix seconds)."""
    return NodeReport(node, 1, 118, 1000, State.TRAINING, productive_seconds=90.0,
                      wall_seconds=100.0, badput_seconds={"startup": 10.0}, reported_at=at,
                      **fields)


@pytest.mark.hardening
@pytest.mark.parametrize("mode", ["NTP", "CKPT-RESTART"])
def test_signal_one_pods_word_that_another_node_went_silent_takes_nothing(mode: str) -> None:
    """A's report names B silent while B's own report is fresh: B keeps its GPUs (NTP: its
    replica stays in the layout; CKPT-RESTART: the attempt goes on, no restart counted). Once
    B's report is late past its period, the same word is believed, and the job asks to be
    reconciled then (no event would come)."""
    job = _job(**_mode(mode))
    now = NOW.timestamp()
    reports = {A: _report(A, now - 1, silent_nodes=(B,)), B: _report(B, now - 4)}
    observed = _in_force(job, reports=reports)
    found, lost = signal.health_of(_spec(job).whole, observed, {0: A, 1: B}, observed.nodes,
                                   NOW)
    assert not found.failed and not lost.failed
    late_at = now - 4 + progress.report_period(2) + health.REPORT_LATE_S
    assert found.recheck_at == late_at
    assert any(f"node {B}: reported silent by {A} alone" in p for p in found.problems)
    state, ended = life.life(_spec(job), observed, NOW)
    assert (state.stage, state.restarts, ended) == (Stage.RUNNING, 0, {})
    later = datetime.fromtimestamp(late_at, UTC)
    found, _ = signal.health_of(_spec(job).whole, observed, {0: A, 1: B}, observed.nodes, later)
    assert found.failed == {(B, i) for i in range(8)}


@pytest.mark.hardening
def test_signal_two_agents_that_agree_a_node_went_silent_take_it_at_once() -> None:
    """Three nodes, each watched by two others: B's two watchers name it, and B's report is
    fresh (a node that froze a moment ago wrote it): lost now, not after its report period.
    A node naming itself, or one that names itself alone, adds no witness."""
    now = NOW.timestamp()
    reports = {A: _report(A, now, silent_nodes=(B, C)), C: _report(C, now, silent_nodes=(B, C)),
               B: _report(B, now - 1)}
    assert health.heard_silent(reports, now).nodes == {B}
    assert health.heard_silent({**reports, C: _report(C, now)}, now).nodes == frozenset()


@pytest.mark.hardening
def test_a_report_spending_more_than_its_wall_time_is_refused_and_goodput_stays_in_bounds(
) -> None:
    """A's report claims a million productive seconds in 100 s of wall time: it is refused on
    read (named in Ready), so the job's goodput is B's alone, within the schema's [0, 1], and
    nothing of it can be folded into earlierAttempts. Rounding each figure to the millisecond
    is no lie."""
    job = _job()
    honest = _report(B, NOW.timestamp())
    lying = honest.to_dict() | {"node": A, "productiveSeconds": 1.0e6}
    rounded = honest.to_dict() | {"node": C, "productiveSeconds": 90.0005,
                                  "badputSeconds": {"startup": 10.0005}}
    reports = progress.parse_reports({f"{A}.json": json.dumps(lying),
                                      f"{B}.json": honest.to_json(),
                                      f"{C}.json": json.dumps(rounded)})
    assert isinstance(reports[A], Unreadable) and "wallSeconds" in reports[A].why
    assert isinstance(reports[C], NodeReport)
    wanted = desired.desired(_spec(job), _in_force(job, reports=reports), NOW)
    assert wanted.status["goodput"] == 0.9
    ready = next(c for c in wanted.status["conditions"] if c["type"] == "Ready")
    assert f"node {A}'s progress report refused" in ready["message"]
    # an account folded before (a hand edit) reads back within its wall time
    assert progress.Account.from_status(
        {"wallSeconds": 100.0, "productiveSeconds": 1.0e6}).productive_seconds == 100.0


# ----------------------------------------------------------------------------------------------
# hardening: failures that must end
# ----------------------------------------------------------------------------------------------


@pytest.mark.hardening
@pytest.mark.parametrize("restarts", [0, 3])
def test_life_a_rank_that_died_again_restarts_the_attempt_then_fails_with_its_error(
        restarts: int) -> None:
    """A rank died again on its GPU without getting past its previous rank's step there (a
    data path that does not exist): not a GPU to hold out and let back for ever, but a restart
    of the attempt from its checkpoint, counted; with maxRestarts (3) spent, the job fails
    with the rank's last error in its Failed condition."""
    job = _job(**_mode("NTP"))
    error = "exited with 1: ntp.dataset.DatasetError: no dataset at /data/x (not a directory)"
    death = RankDeath(NOW.timestamp() - 2, None, error, again=True)
    observed = _in_force(job, reports={A: NodeReport(A, 1, 0, 1000, State.RECONFIGURING,
                                                     rank_deaths={3: death})})
    observed = replace(observed, job=observed.job | {"status": observed.job["status"] | {
        "restarts": restarts}})
    found, _ = life.life(_spec(job), observed, NOW)
    if restarts < 3:
        assert (found.stage, found.restarts, found.ended) == (Stage.STOPPING, restarts + 1, True)
        return
    assert found.stage is Stage.FINISHED and found.finish is not None
    assert found.finish.reason == "RestartLimitReached" and error in found.finish.message
    assert f"GPU {A}/3 died again" in found.finish.message
    # a death that is not again is the GPU's: held out, not a restart
    once = replace(observed, reports={A: NodeReport(A, 1, 0, 1000, State.RECONFIGURING,
                                                    rank_deaths={3: replace(death, again=False)})})
    assert life.life(_spec(job), once, NOW)[0].stage is Stage.RUNNING


def _waiting(pod: dict[str, Any], created: float, **status: Any) -> dict[str, Any]:
    meta = pod["metadata"] | {"creationTimestamp": datetime.fromtimestamp(
        created, UTC).isoformat().replace("+00:00", "Z")}
    return pod | {"metadata": meta, "status": {"phase": "Pending"} | status}


SCHEDULED = {"type": "PodScheduled", "status": "True"}
UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 1 Insufficient nvidia.com/gpu."}
PULL = {"name": "trainer", "state": {"waiting": {
    "reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/x/trainer:nope"'}}}
INIT = {"name": "fetch", "state": {"running": {"startedAt": "2026-12-01T07:00:00Z"}}}


@pytest.mark.hardening
@pytest.mark.parametrize(("status", "reason", "words"), [
    ({"conditions": [UNSCHEDULABLE]}, "Unschedulable", "Insufficient nvidia.com/gpu"),
    ({"conditions": [SCHEDULED], "containerStatuses": [PULL]}, "ImagePullBackOff",
     "container trainer: Back-off pulling image"),
    ({"conditions": [SCHEDULED], "initContainerStatuses": [INIT]}, "InitContainerRunning",
     "init container fetch running since"),
])
@pytest.mark.parametrize("action", ["Restart", "Fail"])
def test_pods_that_never_start_say_why_then_the_attempt_gives_up_by_the_jobs_policy(
        status: dict[str, Any], reason: str, words: str, action: str) -> None:
    """A trainer pod that cannot start holds its node: PodsStarted says why (the scheduler's
    or the kubelet's reason) and when the attempt gives up; the job asks to be reconciled
    then. At podStartTimeoutSeconds its pods are deleted: a restart counted (Restart), or the
    job fails (Fail)."""
    job = _job(failurePolicy=EXAMPLE["spec"]["failurePolicy"] | {"onPodStartTimeout": action})
    timeout = _spec(job).whole.failure_policy.pod_start_timeout_seconds
    created = NOW.timestamp() - 60
    rendezvous, first, second = _pods(job)
    pods = (_waiting(rendezvous, created, phase="Running", podIP=IP),
            _waiting(first, created, phase="Running"), _waiting(second, created, **status))
    observed = _in_force(job, pods=pods)
    wanted = desired.desired(_spec(job), observed, NOW)
    started = next(c for c in wanted.status["conditions"] if c["type"] == "PodsStarted")
    assert (started["status"], started["reason"]) == ("False", reason)
    assert words in started["message"] and f"onPodStartTimeout {action}" in started["message"]
    assert wanted.requeue_after == pytest.approx(timeout - 60)
    late = datetime.fromtimestamp(created + timeout, UTC)
    found, _ = life.life(_spec(job), observed, late)
    if action == "Restart":
        assert (found.stage, found.restarts) == (Stage.STOPPING, 1)
    else:
        assert found.stage is Stage.FINISHED and found.finish is not None
        assert found.finish.reason == "PodStartTimeout" and reason in found.finish.message
    assert set(found.delete_pods) == {p["metadata"]["name"] for p in pods}  # nodes released


@pytest.mark.hardening
def test_a_loss_while_a_planned_switch_is_pending_leaves_its_joining_gpus_out() -> None:
    """Generation 3 is planned (A/3 back after its rank died: a process still to start) and no
    node trains in it yet when B/5's rank dies. The generation that follows the loss leaves
    A/3 out as well as B/5: with it the survivors would wait at its rendezvous for a process
    still starting (a planned generation's 600 s timeout when it never comes). A loss outside
    the pending generation, or once a node trains in it, holds nothing back."""
    job = _job(**_mode("NTP"))
    first = _first_generation(job)
    a3, b5 = Gpu(A, 3), Gpu(B, 5)
    without_a3 = next_generation(first, [[g for g in r if g != a3] for r in first.replicas],
                                 lost={a3})
    planned = next_generation(without_a3, first.replicas, at_step=130)
    died = NodeReport(B, 2, 125, 1000, State.RECONFIGURING,
                      rank_deaths={5: RankDeath(NOW.timestamp() - 1)})
    reports = {A: NodeReport(A, 2, 125, 1000, State.TRAINING), B: died}
    observed = replace(_in_force(job, reports=reports),
                       layout=Layout("9", generation=planned))
    observed = replace(observed, job=observed.job | {"status": {"layoutGeneration": 3}})
    wanted = desired.desired(_spec(job), observed, NOW)
    assert wanted.layout is not None
    after = Generation.from_dict(json.loads(wanted.layout["data"][LAYOUT_KEY]))
    assert after.generation == 4 and after.at_step is None
    assert {a3, b5}.isdisjoint(g for r in after.replicas for g in r)
    assert publish.held_back(planned, reports, frozenset({(A, 0)})).failed == {(A, 3)}
    assert not publish.held_back(planned, reports, frozenset({(C, 0)})).failed
    trained = {**reports, A: NodeReport(A, 3, 131, 1000, State.TRAINING)}
    assert not publish.held_back(planned, trained, frozenset({(B, 5)})).failed
