"""The desired state of a job as a pure function, no API server: a job spec and an observed world
in, the children, the layout document, the power targets and the status out."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from tessera_contracts.generation import LAYOUT_KEY, Generation
from tessera_contracts.powertarget import format_time
from tessera_contracts.progress import NodeReport, State, report_key
from tessera_dev import paths
from tessera_operator import desired, workload
from tessera_operator.observed import Candidates, Layout, Observed

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
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1}
    job["spec"] |= {"nodeSelector": POOL} | spec
    return job


JOB = _job()
PLACED_JOB = JOB | {"status": {"layoutGeneration": 1}}


def _node(name: str, cordon: str | None = None) -> dict[str, Any]:
    annotations = {} if cordon is None else {"tessera.dev/cordoned-gpus": cordon}
    return {"metadata": {"name": name, "labels": dict(POOL), "annotations": annotations},
            "spec": {}, "status": {"allocatable": {workload.GPU_RESOURCE: "8"},
                                   "conditions": [{"type": "Ready", "status": "True"}]}}


def _pods(job: dict[str, Any], ip: str | None) -> tuple[dict[str, Any], ...]:
    """The job's pods as the operator made them, placed on A and B; the rendezvous with an
    address when `ip` is given."""
    rendezvous = workload.rendezvous_pod(job) | {"status": {"podIP": ip} if ip else {}}
    return (rendezvous, workload.trainer_pod(job, 0, A), workload.trainer_pod(job, 1, B))


def _report(node: str, step: int) -> tuple[str, str]:
    return report_key(node), NodeReport(node, 1, step, 1000, State.TRAINING).to_json()


def _gpu_health(node: str, xids: dict[int, list[int]]) -> dict[str, Any]:
    return {"metadata": {"name": node},
            "status": {"observedAt": format_time(NOW), "gpus": [
                {"index": i, "state": "Healthy", "xids": xids.get(i, [])} for i in range(8)]}}


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
        Observed(JOB, candidates=Candidates((_node(A), _node(B)), ())), EVERY_CHILD,
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
        Observed(JOB, candidates=Candidates((_node(A),), ())), [], ("False", "Unschedulable"),
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


def test_a_fresh_job_is_placed_on_free_nodes_under_deterministic_names() -> None:
    observed = CASES["a fresh job on two free nodes, its rendezvous without an address yet"
                     ].observed
    assert desired.needs_placement(desired.job_spec(observed.job), observed)
    wanted = _desired(observed, NOW)
    assert wanted == _desired(observed, NOW)  # the same world, the same objects
    assert wanted.placement == {0: A, 1: B}
    pinned = {c["metadata"]["name"]: workload.pod_node(c) for c in wanted.children
              if c["kind"] == "Pod"}
    assert pinned == {"llama-rendezvous": None, "llama-node-0": A, "llama-node-1": B}
    assert all(c["metadata"]["ownerReferences"] == [workload.owner(JOB)] for c in wanted.children)
    # Placed, the job needs nothing more placed.
    assert not desired.needs_placement(desired.job_spec(JOB), PLACED)


def test_a_node_whose_gpus_other_pods_hold_is_not_chosen() -> None:
    other = {"metadata": {"name": "theirs"}, "spec": {"nodeName": B, "containers": [
        {"resources": {"limits": {workload.GPU_RESOURCE: "1"}}}]}, "status": {"phase": "Running"}}
    wanted = _desired(
        Observed(JOB, candidates=Candidates((_node(A), _node(B), _node("gpu-c")), (other,))),
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
