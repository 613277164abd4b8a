"""The desired state of a job as a pure function, no API server: a job spec and an observed world
in, the children, the layout document, the power targets and the status out."""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from tessera_contracts.generation import LAYOUT_KEY, Generation, Gpu
from tessera_contracts.gpuhealth import PublishedHealth, read
from tessera_contracts.jobspec import NTPTrainingJobSpec, defaulted
from tessera_contracts.powertarget import format_time, to_object
from tessera_contracts.progress import NodeReport, State
from tessera_contracts.unreadable import Unreadable
from tessera_dev import paths
from tessera_operator import desired, health, workload
from tessera_operator.observed import Candidates, Layout, Observed
from tessera_operator.policies import memory as memory_policy
from tessera_operator.policies import placement, publish

pytestmark = pytest.mark.operator

NOW = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
A, B = "gpu-a", "gpu-b"
POOL = {"pool.tessera.dev/name": "llama"}
IP = "10.0.0.5"
EXAMPLE = yaml.safe_load(
    (paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())
POWER = EXAMPLE["spec"]["powerPolicy"]
BASE, CAP, BUDGET = POWER["baseCapWatts"], POWER["boostCapWatts"], POWER["rackBudgetWatts"]
ABSENT = object()  # a key the layout document must not have


def _job(**spec: Any) -> dict[str, Any]:
    """The example job on the pool's nodes, as the API server stores it (the CRD's defaults
    filled in)."""
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1}
    job["spec"]["template"]["spec"]["nodeSelector"] = dict(POOL)
    job["spec"] = defaulted(job["spec"] | spec)
    return job


JOB = _job()
PLACED_JOB = JOB | {"status": {"layoutGeneration": 1}}


def _node(name: str, cordon: str | None = None) -> dict[str, Any]:
    annotations = {} if cordon is None else {"tessera.dev/cordoned-gpus": cordon}
    return {"metadata": {"name": name, "labels": dict(POOL), "annotations": annotations},
            "spec": {}, "status": {"allocatable": {workload.GPU_RESOURCE: "8"},
                                   "conditions": [{"type": "Ready", "status": "True"}]}}


def _spec(job: dict[str, Any]) -> NTPTrainingJobSpec:
    return NTPTrainingJobSpec.from_spec(job["spec"])


def _pods(job: dict[str, Any], ip: str | None) -> tuple[dict[str, Any], ...]:
    """The job's pods as the operator made them, placed on A and B; the rendezvous with an
    address when `ip` is given."""
    spec = _spec(job)
    rendezvous = workload.rendezvous_pod(job, spec) | {"status": {"podIP": ip} if ip else {}}
    return (rendezvous, workload.trainer_pod(job, spec, 0, A),
            workload.trainer_pod(job, spec, 1, B))


def _report(node: str, step: int) -> tuple[str, NodeReport]:
    return node, NodeReport(node, 1, step, 1000, State.TRAINING)


def _gpu_health(node: str, xids: dict[int, list[int]], at: datetime = NOW
                ) -> PublishedHealth | Unreadable:
    """The node's GPUHealth as the operator's index holds it."""
    return read({"metadata": {"name": node},
                 "status": {"observedAt": format_time(at), "gpus": [
                     {"index": i, "state": "Healthy", "xids": xids.get(i, [])}
                     for i in range(8)]}})


def _desired(observed: Observed, now: datetime) -> desired.Desired:
    return desired.desired(desired.job_spec(observed.job), observed, now)


def _document(layout: dict[str, Any] | None) -> dict[str, Any]:
    assert layout is not None
    return json.loads(layout["data"][LAYOUT_KEY])


# The job placed on A and B, its rendezvous reachable: generation 1 to publish.
PLACED = Observed(JOB, pods=_pods(JOB, IP), nodes=(_node(A), _node(B)))
GENERATION_1 = Generation.from_dict(_document(_desired(PLACED, NOW).layout))
# Generation 1 in force, both nodes training (one ahead of the other).
TRAINING = replace(PLACED, job=PLACED_JOB, layout=Layout("7", generation=GENERATION_1),
                   reports=dict([_report(A, 118), _report(B, 120)]))

EVERY_CHILD = [("ServiceAccount", "llama-trainer"), ("Role", "llama-trainer"),
               ("RoleBinding", "llama-trainer"), ("ConfigMap", "llama-progress"),
               ("Pod", "llama-rendezvous"), ("Pod", "llama-node-0"), ("Pod", "llama-node-1")]


@dataclass(frozen=True)
class Case:
    observed: Observed
    children: list[tuple[str, str]]  # (kind, name) of every object the job runs
    ready: tuple[str, str]  # Ready's status and reason
    tp_layout: str
    layout: dict[str, Any] | None = None  # what the document to publish holds; None: none


CASES = {
    "a fresh job on two free nodes, its rendezvous without an address yet": Case(
        Observed(JOB, candidates=Candidates((_node(A), _node(B)))), EVERY_CHILD,
        ("True", "AllReplicasHealthy"), "8,8"),
    "placed, the rendezvous has an address: generation 1": Case(
        PLACED, EVERY_CHILD, ("True", "AllReplicasHealthy"), "8,8",
        {"generation": 1, "rendezvous": {"host": IP, "port": workload.RENDEZVOUS_PORT},
         "atStep": ABSENT}),
    "a cordoned GPU: a planned generation at the last step reported": Case(
        replace(TRAINING, nodes=(_node(A, cordon="3"), _node(B))), EVERY_CHILD,
        ("True", "RunningDegraded"), "7,8", {"generation": 2, "atStep": 120}),
    "a GPU lost under its process: an unplanned generation": Case(
        replace(TRAINING, gpu_health=(_gpu_health(A, {3: [79]}), _gpu_health(B, {}))),
        EVERY_CHILD, ("True", "RunningDegraded"), "7,8", {"generation": 2, "atStep": ABSENT}),
    "one free node where two are needed: unschedulable, nothing made": Case(
        Observed(JOB, candidates=Candidates((_node(A),))), [], ("False", "Unschedulable"),
        ""),
    "an invalid spec: nothing made": Case(
        Observed(_job(model={"heads": 32})), [], ("False", "InvalidSpec"), ""),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_desired_state_of_a_job(case: Case) -> None:
    wanted = _desired(case.observed, NOW)
    assert [(c["kind"], c["metadata"]["name"]) for c in wanted.children] == case.children
    ready = next(c for c in wanted.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == case.ready, ready["message"]
    assert wanted.waits_for_nodes == (ready["reason"] in desired.WAITS_FOR_NODES)
    assert wanted.status["tpLayout"] == case.tp_layout
    if case.layout is None:
        assert wanted.layout is None
        return
    document = _document(wanted.layout)
    for key, value in case.layout.items():
        assert document.get(key, ABSENT) == value, key
    assert wanted.status["layoutGeneration"] == document["generation"]
    assert ("LayoutChanged", f"layout generation {document['generation']}: TP {case.tp_layout}"
            ) in {(e.reason, e.message) for e in wanted.events}


def test_what_a_family_adds_to_the_model_is_published_to_the_trainers() -> None:
    # Qwen3-style: a head size of its own, QK norms, a tied head
    family = {"headDim": 64, "qkNorm": True, "tiedEmbeddings": True}
    job = _job(model=EXAMPLE["spec"]["model"] | family)
    observed = replace(PLACED, job=job, pods=_pods(job, IP))
    document = _document(_desired(observed, NOW).layout)
    assert document["model"] == EXAMPLE["spec"]["model"] | family


def test_a_fresh_job_is_placed_on_free_nodes_under_deterministic_names() -> None:
    observed = CASES["a fresh job on two free nodes, its rendezvous without an address yet"
                     ].observed
    assert placement.needs_placement(desired.job_spec(observed.job), observed, NOW)
    wanted = _desired(observed, NOW)
    assert wanted == _desired(observed, NOW)  # the same world, the same objects
    assert wanted.placement == {0: A, 1: B}
    pinned = {c["metadata"]["name"]: workload.pod_node(c) for c in wanted.children
              if c["kind"] == "Pod"}
    assert pinned == {"llama-rendezvous": None, "llama-node-0": A, "llama-node-1": B}
    assert all(c["metadata"]["ownerReferences"] == [workload.owner(JOB)] for c in wanted.children)
    # Placed, the job needs nothing more placed.
    assert not placement.needs_placement(desired.job_spec(JOB), PLACED, NOW)


def test_a_node_whose_gpus_other_pods_hold_is_not_chosen() -> None:
    other = {"metadata": {"name": "theirs"}, "spec": {"nodeName": B, "containers": [
        {"resources": {"limits": {workload.GPU_RESOURCE: "1"}}}]}, "status": {"phase": "Running"}}
    wanted = _desired(
        Observed(JOB, candidates=Candidates((_node(A), _node(B), _node("gpu-c")),
                                        workload.taken_gpus([other]))),
        NOW)
    assert wanted.placement == {0: A, 1: "gpu-c"}


def test_ntp_pw_boosts_a_degraded_replica_within_its_rack_budget() -> None:
    wanted = _desired(CASES["a cordoned GPU: a planned generation at the last step "
                                   "reported"].observed, NOW)
    cut = {i: wanted.targets[A].watts_for(i) for i in range(8)}
    # The cordoned GPU goes to the minimum, its survivors share what is left of the budget.
    assert cut[3] == 200
    assert {w for i, w in cut.items() if i != 3} == {min(CAP, (BUDGET - 200) // 7)}
    assert min(w for i, w in cut.items() if i != 3) > BASE and sum(cut.values()) <= BUDGET
    assert {wanted.targets[B].watts_for(i) for i in range(8)} == {BASE}
    boosted = next(c for c in wanted.status["conditions"] if c["type"] == "PowerBoosted")
    assert (boosted["status"], boosted["reason"]) == ("True", "SurvivorsBoosted")
    reduced = next(r for r in wanted.status["replicas"] if r["tensorParallelSize"] == 7)
    assert reduced["powerBoosted"] and reduced["failedGPUs"] == [f"{A}/3"]


def test_no_generation_is_planned_past_the_last_step_its_pods_were_told() -> None:
    """spec.steps raised while the pods run to 1000 (RestartPending): their ranks still end at
    step 1000, so a cordon at step 999 publishes no switch for step 1000, which nobody would
    train."""
    cordoned = replace(CASES["a cordoned GPU: a planned generation at the last step "
                             "reported"].observed, reports=dict([_report(A, 999),
                                                                 _report(B, 1000)]))
    assert _desired(cordoned, NOW).layout is None
    raised = PLACED_JOB | {"spec": PLACED_JOB["spec"] | {"steps": 2000}}
    assert _desired(replace(cordoned, job=raised), NOW).layout is None
    # Short of the pods' last step, the same cordon is planned.
    ahead = replace(cordoned, job=raised, reports=dict([_report(A, 900), _report(B, 901)]))
    assert _document(_desired(ahead, NOW).layout)["atStep"] == 901


def test_a_job_without_a_plan_releases_its_power_targets() -> None:
    for name in ("one free node where two are needed: unschedulable, nothing made",
                 "an invalid spec: nothing made"):
        wanted = _desired(CASES[name].observed, NOW)
        assert wanted.targets == {} and wanted.status["phase"] == "Pending"


def test_a_status_key_no_longer_rendered_is_left_out() -> None:
    """The status is rebuilt whole: a key of the previous one that no longer holds (the step
    once the reports are gone) is not in it, and the status write clears it."""
    before = replace(TRAINING, job=PLACED_JOB | {"status": {"layoutGeneration": 1, "step": 7,
                                                            "goodput": 0.5}})
    assert _desired(before, NOW).status["step"] == 118
    gone = _desired(replace(before, layout=Layout("7", owned=False)), NOW).status
    assert "step" not in gone and "goodput" not in gone


# ----------------------------------------------------------------------------------------------
# The job's lifecycle: suspension, restarts, attempts; rejected pods, spec edits
# ----------------------------------------------------------------------------------------------


def _spent(node: str, step: int, productive: float, wall: float) -> tuple[str, NodeReport]:
    """A node's report at `step` after `wall` seconds, 2 s a step, the rest of it startup."""
    return node, NodeReport(node, 1, step, 1000, State.TRAINING, step_seconds=2.0,
                            productive_seconds=productive, wall_seconds=wall,
                            badput_seconds={"startup": wall - productive})


def _failed(pods: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """`pods` with the trainer pod on B failed (its process exited 1)."""
    rendezvous, on_a, on_b = pods
    return rendezvous, on_a, on_b | {"status": {"phase": "Failed", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"reason": "Error", "exitCode": 1}}}]}}


def _attempt(job: dict[str, Any], attempt: int) -> tuple[dict[str, Any], ...]:
    """The job's pods of `attempt` on A and B, the rendezvous with an address."""
    spec = _spec(job)
    return (workload.rendezvous_pod(job, spec, attempt) | {"status": {"podIP": IP}},
            workload.trainer_pod(job, spec, 0, A, attempt),
            workload.trainer_pod(job, spec, 1, B, attempt))


SUSPENDED_JOB = _job(suspend=True)
# Generation 1 in force, the layout and progress ConfigMaps of attempt 0 (the job's first).
RUNNING_0 = replace(TRAINING, configmap_attempts={"llama-layout": 0, "llama-progress": 0},
                    reports=dict([_spent(A, 118, 300.0, 400.0), _spent(B, 120, 310.0, 400.0)]))
# What attempt 0 spent when it ends: the job has no checkpoint before step 500, so it starts
# again at step 0 and each node's steps are lost progress, at 2 s a step: A 118 x 2 = 236 s of
# its 300 productive, B 120 x 2 = 240 of 310. Wall 800; productive 64 + 70 = 134; lost 476;
# startup 100 + 90 = 190.
SPENT = {"wallSeconds": 800.0, "productiveSeconds": 134.0,
         "badputSeconds": {"lost_progress": 476.0, "startup": 190.0}}
GENERATION_2 = Generation.from_dict(_document(_desired(
    CASES["a cordoned GPU: a planned generation at the last step reported"].observed,
    NOW).layout))
# Attempt 1 running on A and B; the layout ConfigMap (generation 2) is still attempt 0's.
ATTEMPT_1_JOB = JOB | {"status": {"attempt": 1, "restarts": 1, "layoutGeneration": 2}}
STALE_LAYOUT = Observed(ATTEMPT_1_JOB, pods=_attempt(JOB, 1), nodes=(_node(A), _node(B)),
                        layout=Layout("9", generation=GENERATION_2),
                        configmap_attempts={"llama-layout": 0, "llama-progress": 1})
EDITED_JOB = PLACED_JOB | {"spec": PLACED_JOB["spec"] | {"image": "tessera-trainer:0.2.0"}}


@dataclass(frozen=True)
class LifeCase:
    observed: Observed
    phase: str
    conditions: dict[str, tuple[str, str]]  # type -> (status, reason), for those named
    status: dict[str, Any]  # what the status holds under these keys (ABSENT: not there)
    children: list[tuple[str, str]]  # (kind, name) of every object the job runs
    targets: bool = False  # whether the job asks for power targets
    ended: bool = False  # an attempt ends in this reconcile
    delete_pods: frozenset[str] = frozenset()
    delete_configmaps: frozenset[str] = frozenset()
    layout_generation: int | None = None  # the generation to publish; None: none
    rejected: str | None = None  # why the API server refused the job's pods


REJECTION = 'pods "llama-node-0" is forbidden: violates PodSecurity "restricted:latest"'
EVERY_POD = frozenset({"llama-rendezvous", "llama-node-0", "llama-node-1"})
BOTH_CONFIGMAPS = frozenset({"llama-layout", "llama-progress"})

LIFE_CASES = {
    "suspended before it ran: nothing made, no power": LifeCase(
        Observed(SUSPENDED_JOB, candidates=Candidates((_node(A), _node(B)))), "Suspended",
        {"Suspended": ("True", "JobSuspended"), "Ready": ("False", "Suspended"),
         "UpToDate": ("True", "PodsCurrent")},
        {"attempt": 0, "restarts": 0, "restartingSince": ABSENT, "earlierAttempts": ABSENT},
        []),
    "suspended while training: the attempt ends, its pods and ConfigMaps go": LifeCase(
        replace(RUNNING_0, job=PLACED_JOB | {"spec": SUSPENDED_JOB["spec"]}), "Suspended",
        {"Suspended": ("True", "JobSuspended"), "Ready": ("False", "Suspended")},
        {"attempt": 1, "restarts": 0, "restartingSince": ABSENT, "earlierAttempts": SPENT},
        [], ended=True, delete_pods=EVERY_POD, delete_configmaps=BOTH_CONFIGMAPS),
    "a trainer pod failed: the attempt ends, a restart begins": LifeCase(
        replace(RUNNING_0, pods=_failed(RUNNING_0.pods)), "Restarting",
        {"Ready": ("False", "Restarting"), "Suspended": ("False", "JobNotSuspended"),
         "Training": ("False", "Restarting")},
        {"attempt": 1, "restarts": 1, "restartingSince": format_time(NOW),
         "earlierAttempts": SPENT, "goodput": round(134.0 / 800.0, 4), "layoutGeneration": 0},
        [], ended=True, delete_pods=EVERY_POD, delete_configmaps=BOTH_CONFIGMAPS),
    "the layout ConfigMap of an earlier attempt: deleted, generation 1 published anew": LifeCase(
        STALE_LAYOUT, "Pending",
        {"Ready": ("True", "AllReplicasHealthy"), "UpToDate": ("True", "PodsCurrent")},
        {"attempt": 1, "restarts": 1, "layoutGeneration": 1, "restartingSince": ABSENT},
        EVERY_CHILD, targets=True, delete_configmaps=frozenset({"llama-layout"}),
        layout_generation=1),
    "the job's pods rejected: no plan, no power": LifeCase(
        TRAINING, "Pending", {"Ready": ("False", "PodRejected")}, {"tpLayout": ""},
        EVERY_CHILD, rejected=REJECTION),
    "spec.image edited under running pods: not up to date": LifeCase(
        replace(TRAINING, job=EDITED_JOB), "Running",
        {"UpToDate": ("False", "RestartPending"), "Ready": ("True", "AllReplicasHealthy")},
        {"attempt": 0, "restarts": 0}, EVERY_CHILD, targets=True),
}


@pytest.mark.parametrize("case", LIFE_CASES.values(), ids=LIFE_CASES.keys())
def test_the_desired_state_of_a_job_through_its_life(case: LifeCase) -> None:
    observed = case.observed
    wanted = desired.desired(desired.job_spec(observed.job), observed, NOW)
    if case.rejected is not None:
        wanted = wanted.pods_rejected(case.rejected)
    assert [(c["kind"], c["metadata"]["name"]) for c in wanted.children] == case.children
    assert bool(wanted.targets) == case.targets
    assert wanted.status["phase"] == case.phase
    found = {c["type"]: c for c in wanted.status["conditions"]}
    for kind, expected in case.conditions.items():
        assert (found[kind]["status"], found[kind]["reason"]) == expected, found[kind]
    for key, value in case.status.items():
        assert wanted.status.get(key, ABSENT) == value, key
    assert wanted.ended == case.ended
    assert set(wanted.delete_pods) == case.delete_pods
    assert set(wanted.delete_configmaps) == case.delete_configmaps
    assert not wanted.delete_job and wanted.requeue_after is None
    if case.layout_generation is None:
        assert wanted.layout is None
        return
    assert _document(wanted.layout)["generation"] == case.layout_generation
    assert workload.attempt_of(wanted.layout) == observed.job["status"]["attempt"]


def test_a_job_that_runs_no_attempt_asks_for_no_placement() -> None:
    for name in ("suspended before it ran: nothing made, no power",
                 "a trainer pod failed: the attempt ends, a restart begins"):
        observed = LIFE_CASES[name].observed
        assert not placement.needs_placement(desired.job_spec(observed.job), observed, NOW)


def test_the_rejection_and_the_edited_fields_are_named_in_the_conditions() -> None:
    rejected = LIFE_CASES["the job's pods rejected: no plan, no power"]
    wanted = desired.desired(desired.job_spec(rejected.observed.job), rejected.observed,
                             NOW).pods_rejected(REJECTION)
    ready = next(c for c in wanted.status["conditions"] if c["type"] == "Ready")
    assert ready["message"].startswith(REJECTION)
    assert ("Warning", "PodRejected") in {(e.type, e.reason) for e in wanted.events}
    edited = _desired(LIFE_CASES["spec.image edited under running pods: not up to date"
                                 ].observed, NOW)
    current = next(c for c in edited.status["conditions"] if c["type"] == "UpToDate")
    assert current["message"].startswith("spec.image changed since the running pods were made")
    assert "spec.template" not in current["message"]
    assert ("Warning", "RestartPending") in {(e.type, e.reason) for e in edited.events}


def test_what_the_api_server_refuses_is_written_into_the_decision_not_decided_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused pods leave the job without a plan, its power targets released; refused power
    targets are named in Ready, no raise said to wait. Neither places the job anew."""
    cordoned = CASES["a cordoned GPU: a planned generation at the last step reported"].observed
    at_base = _desired(TRAINING, NOW).targets
    observed = replace(cordoned, targets=tuple(to_object(t) for t in at_base.values()))
    wanted = _desired(observed, NOW)
    assert wanted.layout is not None and set(wanted.sync.write) == {A}

    def placed_again(*_: Any) -> None:
        raise AssertionError("decided again")

    monkeypatch.setattr(placement, "place", placed_again)
    refused = wanted.power_refused("spec.gpus[0].watts: too many")
    ready = next(c for c in refused.status["conditions"] if c["type"] == "Ready")
    assert ready["message"].endswith("; power targets refused: spec.gpus[0].watts: too many")
    assert refused.held == () and refused.sync == wanted.sync
    assert (refused.layout, refused.targets) == (wanted.layout, wanted.targets)
    rejected = wanted.pods_rejected(REJECTION)
    ready = next(c for c in rejected.status["conditions"] if c["type"] == "Ready")
    assert (ready["reason"], rejected.layout, rejected.targets) == ("PodRejected", None, {})
    assert rejected.sync.write == {} and set(rejected.sync.delete) == {A, B}
    assert rejected.children == wanted.children  # the pods it tried are the ones wanted


def test_a_planned_switch_is_published_for_a_step_the_ranks_have_not_passed() -> None:
    now = NOW.timestamp()
    # Read 3 s after it was made, at 0.5 s a step at the fastest: the ranks may be 6 steps past
    # the newest report, and 4 more before the document reaches them.
    fresh = NodeReport("a", 1, 100, 1000, State.TRAINING, step_seconds=1.0, reported_at=now - 3)
    fast = NodeReport("b", 1, 98, 1000, State.TRAINING, step_seconds=0.5, reported_at=now - 9)
    assert publish.planned_step({"a": fresh, "b": fast}, now) == 100 + 6 + 4
    # a report that does not say when: a whole report period (10 s) old
    unstamped = replace(fresh, reported_at=None)
    assert publish.planned_step({"a": unstamped, "b": fast}, now) == 100 + 20 + 4
    # a clock ahead or far behind counts as no older than 0 s or one period
    ahead = replace(fresh, reported_at=now + 60)
    assert publish.planned_step({"a": ahead, "b": fast}, now) == 100 + 0 + 4
    # before any pace: the step reported, the ranks switching at the first boundary after it
    starting = NodeReport("a", 1, 3, 1000, State.TRAINING)
    assert publish.planned_step({"a": starting, "b": None}, now) == 3
    assert publish.planned_step({}, now) == 0


@pytest.mark.parametrize("forged", [
    NodeReport(B, 1, 999_999, 999_999, State.FINISHED),  # another job's steps
    NodeReport(B, 1, 500, 1000, State.FINISHED),  # finished short of the steps
])
def test_a_report_that_disagrees_with_its_pods_is_refused(forged: NodeReport) -> None:
    observed = replace(TRAINING, reports=dict([_report(A, 118), (B, forged)]))
    status = _desired(observed, NOW).status
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert f"node {B}'s progress report refused" in ready["message"]
    assert status["step"] == 118 and status["phase"] == "Reconfiguring"


def test_a_restart_does_not_wait_for_pods_on_a_node_that_stopped_reporting() -> None:
    """Attempt 0's pods are being deleted; node A's kubelet went silent, so no one will confirm
    its pod's end: that pod is deleted at once, the others end within their grace period."""
    stopping = JOB | {"status": {"attempt": 1, "restarts": 1,
                                 "restartingSince": format_time(NOW)}}
    deleted = tuple(pod | {"metadata": pod["metadata"] | {"deletionTimestamp": format_time(NOW)}}
                    for pod in _pods(JOB, IP))
    silent = _node(A)
    silent["status"]["conditions"] = [{"type": "Ready", "status": "Unknown",
                                       "reason": "NodeStatusUnknown"}]
    observed = Observed(stopping, pods=deleted, nodes=(silent, _node(B)))
    wanted = _desired(observed, NOW)
    assert wanted.status["phase"] == "Restarting"
    assert wanted.force_delete_pods == ("llama-node-0",)
    assert _desired(replace(observed, nodes=(_node(A), _node(B))), NOW).force_delete_pods == ()
    # a pod not being deleted is not taken from a silent node: the restart deletes it first
    assert _desired(replace(observed, pods=_pods(JOB, IP)), NOW).force_delete_pods == ()


def test_the_jobs_rank_death_hold_is_the_one_it_waits_out() -> None:
    """`failurePolicy.rankDeathHoldSeconds` (the CRD's default, the operator's
    `RANK_DEATH_HOLD_S`, is the next test's)."""
    job = _job(failurePolicy=JOB["spec"]["failurePolicy"] | {"rankDeathHoldSeconds": 10}) | {
        "status": {"layoutGeneration": 1}}
    dead = NodeReport(A, 1, 118, 1000, State.RECONFIGURING,
                      rank_deaths={3: NOW.timestamp() - 0.5})
    observed = replace(TRAINING, job=job, reports=dict([_report(B, 120)]) | {A: dead})
    assert _desired(observed, NOW).requeue_after == pytest.approx(10 - 0.5)


def test_a_dead_ranks_gpu_leaves_at_once_and_comes_back_on_a_later_healthy_verdict() -> None:
    """The node agent saw the rank on A/3 die; DCGM has said nothing since (a software fault,
    or its verdict not in yet): the survivors go on without A/3 at once, in a generation after
    a loss, and the job asks to be reconciled when the hold ends. Once DCGM calls the GPU
    healthy after the death, it joins again at a planned step."""
    died = NOW.timestamp() - 0.5
    earlier = datetime.fromtimestamp(NOW.timestamp() - 30, UTC)
    dead = NodeReport(A, 1, 118, 1000, State.RECONFIGURING, rank_deaths={3: died})
    observed = replace(TRAINING, reports=dict([_report(B, 120)]) | {A: dead},
        gpu_health=(_gpu_health(A, {}, earlier), _gpu_health(B, {}, earlier)))
    wanted = _desired(observed, NOW)
    lost = Generation.from_dict(_document(wanted.layout))
    assert (lost.generation, lost.at_step, lost.tp_degrees) == (2, None, (7, 8))
    assert (A, 3) not in {(g.node, g.index) for g in lost.gpus}
    assert wanted.requeue_after == pytest.approx(health.RANK_DEATH_HOLD_S - 0.5)
    assert "its rank died" in json.dumps(wanted.status)
    # DCGM's verdict after the death says healthy: A/3 comes back, planned
    after = datetime.fromtimestamp(NOW.timestamp() + 2, UTC)
    back = replace(observed, job=JOB | {"status": {"layoutGeneration": 2}},
                   layout=Layout("8", generation=lost),
                   gpu_health=(_gpu_health(A, {}, after), _gpu_health(B, {}, after)))
    rejoined = Generation.from_dict(_document(_desired(back, after).layout))
    assert rejoined.generation == 3 and rejoined.at_step is not None
    assert rejoined.tp_degrees == (8, 8)
    assert rejoined.origin is not None
    assert rejoined.origin[rejoined.rank_of(Gpu(A, 3))] is None


# ----------------------------------------------------------------------------------------------
# The memory plan: checked before any pod, on the GPU memory the nodes publish
# ----------------------------------------------------------------------------------------------

H100_MIB = 81559  # an H100 SXM's nvidia.com/gpu.memory, as GPU feature discovery labels it


def _by_label(**spec: Any) -> dict[str, Any]:
    """The example job without spec.gpuMemory: its GPUs' memory is the nodes' label."""
    job = _job(**spec)
    del job["spec"]["gpuMemory"]
    return job


def _gpu_node(name: str, mib: int, cordon: str | None = None) -> dict[str, Any]:
    node = _node(name, cordon)
    node["metadata"]["labels"][memory_policy.GPU_MEMORY_LABEL] = str(mib)
    return node


def _condition(wanted: desired.Desired, kind: str) -> dict[str, Any]:
    return next(c for c in wanted.status["conditions"] if c["type"] == kind)


def test_a_job_whose_healthy_layout_does_not_fit_its_gpus_gets_no_child() -> None:
    """Each replica's 32 sequences of 8,192 tokens in one pass do not fit an H100's 80 GB: the
    job is not placed, FitsMemory=False names the layout, the rank and the numbers, and a node
    change is waited for."""
    job = _by_label()
    del job["spec"]["microBatchSize"]
    nodes = (_gpu_node(A, H100_MIB), _gpu_node(B, H100_MIB))
    wanted = _desired(Observed(job, candidates=Candidates(nodes)), NOW)
    assert wanted.children == () and wanted.layout is None and wanted.targets == {}
    fits, ready = _condition(wanted, "FitsMemory"), _condition(wanted, "Ready")
    assert (fits["status"], fits["reason"]) == ("False", "MemoryDoesNotFit")
    assert (ready["status"], ready["reason"]) == ("False", "MemoryDoesNotFit")
    assert wanted.waits_for_nodes
    found = re.fullmatch(
        r"does not fit: layout 8,8 needs ([\d.]+) GiB on rank \d of replica \d \(TP 8\) for a "
        r"training step, ([\d.]+) GiB usable of ([\d.]+) GiB per GPU \(([\d.]+) GiB from node "
        rf"{A}'s nvidia\.com/gpu\.memory label\)", fits["message"])
    assert found, fits["message"]
    need, usable, total, labelled = map(float, found.groups())
    gib = H100_MIB / 1024
    assert total == labelled == pytest.approx(gib, abs=0.05)
    # docs/memory.md's reserve: 2 GiB, and 5% of what the allocator holds
    assert usable == pytest.approx((gib - 2) / 1.05, abs=0.1)
    assert need > usable
    assert ("Warning", "MemoryDoesNotFit") in {(e.type, e.reason) for e in wanted.events}
    # one sequence a pass fits: the job is placed and FitsMemory says by how much
    placed = _desired(Observed(_by_label(), candidates=Candidates(nodes)), NOW)
    assert [c["metadata"]["name"] for c in placed.children] == [n for _, n in EVERY_CHILD]
    assert (_condition(placed, "FitsMemory")["status"],
            _condition(placed, "FitsMemory")["reason"]) == ("True", "Fits")


def test_without_a_gpu_memory_the_plan_is_not_checked_and_the_job_runs() -> None:
    wanted = _desired(Observed(_by_label(), candidates=Candidates((_node(A), _node(B)))), NOW)
    assert len(wanted.children) == len(EVERY_CHILD)
    fits = _condition(wanted, "FitsMemory")
    assert (fits["status"], fits["reason"]) == ("Unknown", "GPUMemoryUnknown")


def test_a_malformed_gpu_memory_label_is_left_out_logged_and_said(
        caplog: pytest.LogCaptureFixture) -> None:
    garbled = _gpu_node(B, H100_MIB)
    garbled["metadata"]["labels"][memory_policy.GPU_MEMORY_LABEL] = "80GB"
    with caplog.at_level(logging.WARNING):
        wanted = _desired(Observed(_by_label(), candidates=Candidates(
            (_gpu_node(A, H100_MIB), garbled))), NOW)
    said = f"node {B}'s nvidia.com/gpu.memory label '80GB' is not a whole number of MiB"
    fits = _condition(wanted, "FitsMemory")
    assert (fits["status"], fits["reason"]) == ("True", "Fits")
    assert f"from node {A}'s" in fits["message"] and said in fits["message"]
    assert said in caplog.text
    # the only label malformed: the memory is not known, and the message says why
    unknown = _desired(Observed(_by_label(), candidates=Candidates((_node(A), garbled))), NOW)
    fits = _condition(unknown, "FitsMemory")
    assert (fits["status"], fits["reason"]) == ("Unknown", "GPUMemoryUnknown")
    assert said in fits["message"]


def test_a_degraded_layout_that_does_not_fit_raises_the_minimum_tp_the_planner_keeps_to() -> None:
    """60 GiB GPUs hold the example at TP 7 but not a TP 6 rank (docs/memory.md): FitsMemory
    says the effective minimum TP is 7, and two GPUs cordoned on A drop A's replica instead of
    running it at TP 6 as minTensorParallelSize 6 alone would."""
    sixty = 60 * 1024
    nodes = (_gpu_node(A, sixty, cordon="2,3"), _gpu_node(B, sixty))
    wanted = _desired(replace(TRAINING, job=_by_label() | {"status": {"layoutGeneration": 1}},
                              nodes=nodes), NOW)
    fits = _condition(wanted, "FitsMemory")
    assert (fits["status"], fits["reason"]) == ("True", "MinimumTensorParallelRaised")
    assert fits["message"].startswith("fits down to TP 7, not 6: layout ")
    assert "the effective minimum TP is 7" in fits["message"]
    assert wanted.status["tpLayout"] == "8"
    # the same GPUs with the memory of an H100: TP 6 fits, and A's replica runs at TP 6
    roomy = (_gpu_node(A, H100_MIB, cordon="2,3"), _gpu_node(B, H100_MIB))
    assert _desired(replace(TRAINING, nodes=roomy), NOW).status["tpLayout"] == "6,8"
