"""A job labelled with a Kueue queue, as pure functions (no API server): the Workload Tessera
builds for it, and what the job does while Kueue has not admitted it, once it admits it (its
flavor on the pods), when it evicts it (suspended, then the quota given back) and once it
finished (the Workload marked Finished)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from tessera_contracts.jobspec import defaulted
from tessera_dev import paths
from tessera_operator import desired, kueue_workload, workload
from tessera_operator.kueue_workload import PriorityRef
from tessera_operator.observed import Candidates, Observed, Queue, Spec

pytestmark = pytest.mark.operator

NOW = datetime(2026, 12, 7, 8, 0, tzinfo=UTC)
EXAMPLE = yaml.safe_load(
    (paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())
FLAVOR = {"metadata": {"name": "h100"},
          "spec": {"nodeLabels": {"gpu.tessera.dev/model": "h100"},
                   "tolerations": [{"key": "team", "operator": "Equal", "value": "ml",
                                    "effect": "NoSchedule"}]}}
LOW = (PriorityRef("kueue.x-k8s.io", "WorkloadPriorityClass", "low"), 100)


def _job(labels: dict[str, str] | None = None, **status: Any) -> dict[str, Any]:
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1,
                       "labels": {kueue_workload.QUEUE_LABEL: "team-a"} if labels is None
                       else labels}
    job["spec"] = defaulted(job["spec"])
    if status:
        job["status"] = status
    return job


def _spec(job: dict[str, Any]) -> Spec:
    found = desired.job_spec(job)
    assert isinstance(found, Spec)
    return found


def _workload(*conditions: tuple[str, str, str], admitted: bool = False) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [
        {"type": t, "status": s, "reason": r, "message": f"{r} message"}
        for t, s, r in conditions]}
    if admitted:
        status["admission"] = {"clusterQueue": "gpus", "podSetAssignments": [
            {"name": "trainer", "count": 2,
             "flavors": {"cpu": "h100", "memory": "h100", "nvidia.com/gpu": "h100"}},
            {"name": "rendezvous", "count": 1, "flavors": {"cpu": "h100"}}]}
    return {"metadata": {"name": "llama-workload", "namespace": "ml", "resourceVersion": "7"},
            "status": status}


ADMITTED = _workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"),
                     admitted=True)
PREEMPTED = _workload(("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"),
                      ("Evicted", "True", "Preempted"), ("Preempted", "True", "InClusterQueue"),
                      admitted=True)


def _node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"gpu.tessera.dev/model": "h100"}},
            "spec": {}, "status": {"allocatable": {workload.GPU_RESOURCE: "8"},
                                   "conditions": [{"type": "Ready", "status": "True"}]}}


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_the_workload_asks_for_each_trainer_pods_gpus_cpu_and_memory_and_the_rendezvous() -> None:
    job = _job()
    built = kueue_workload.build(job, _spec(job).whole, "team-a", LOW)
    assert built["metadata"]["name"] == "llama-workload"
    assert built["metadata"]["labels"] == {"tessera.dev/job": "llama",
                                           kueue_workload.QUEUE_LABEL: "team-a"}
    (owner,) = built["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "NTPTrainingJob", "llama", "uid-1", True)
    assert built["spec"]["queueName"] == "team-a"
    assert built["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "low"}
    assert built["spec"]["priority"] == 100
    trainer, rendezvous = built["spec"]["podSets"]
    # the example: 16 GPUs on nodes of 8, each trainer pod asking 64 CPUs and 1500Gi
    assert (trainer["name"], trainer["count"]) == ("trainer", 2)
    (container,) = trainer["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {
        "cpu": "64", "memory": "1500Gi", "nvidia.com/gpu": "8"}
    # placed as the template places the pods, never pinned to a node before admission
    assert trainer["template"]["spec"]["tolerations"] == \
        EXAMPLE["spec"]["template"]["spec"]["tolerations"]
    assert "affinity" not in trainer["template"]["spec"]
    assert (rendezvous["name"], rendezvous["count"]) == ("rendezvous", 1)
    assert "nvidia.com/gpu" not in rendezvous["template"]["spec"]["containers"][0][
        "resources"]["requests"]


def test_a_job_without_a_queue_is_left_to_itself() -> None:
    job = _job(labels={})
    found = desired.desired(_spec(job), Observed(job, candidates=Candidates(())), NOW)
    assert found.workload is None and not found.workload_status
    assert _conditions(found.status)["Suspended"]["status"] == "False"


def test_a_queued_job_waits_suspended_for_kueue_with_its_workload_made() -> None:
    job = _job()
    for queue, says in ((Queue(), "its Workload llama-workload is being created"),
                        (Queue(_workload(("QuotaReserved", "False", "Pending"))),
                         "Kueue has not admitted its Workload llama-workload: Pending message")):
        found = desired.desired(_spec(job), Observed(job, queue=queue), NOW)
        suspended = _conditions(found.status)["Suspended"]
        assert (suspended["status"], suspended["reason"]) == ("True", "WaitingForKueue")
        assert says in suspended["message"]
        assert _conditions(found.status)["Ready"]["reason"] == "WaitingForKueue"
        assert found.status["phase"] == "Suspended"
        assert found.children == () and found.workload is not None
        assert found.workload["spec"]["queueName"] == "team-a"


def test_a_missing_priority_class_is_said_and_no_workload_is_made() -> None:
    job = _job()
    found = desired.desired(_spec(job), Observed(
        job, queue=Queue(priority_missing="WorkloadPriorityClass urgent")), NOW)
    assert found.workload is None
    assert "WorkloadPriorityClass urgent does not exist" in \
        _conditions(found.status)["Suspended"]["message"]


def test_an_admitted_job_runs_on_its_flavor() -> None:
    job = _job()
    observed = Observed(job, queue=Queue(ADMITTED, {"h100": FLAVOR}),
                        candidates=Candidates((_node("n0"), _node("n1"), {
                            **_node("other"), "metadata": {"name": "other", "labels": {}}})))
    found = desired.desired(_spec(job), observed, NOW)
    assert _conditions(found.status)["Suspended"]["status"] == "False"
    assert sorted(found.placement.values()) == ["n0", "n1"]  # not the node outside the flavor
    pods = [c for c in found.children if c["kind"] == "Pod"]
    assert len(pods) == 3
    for pod in pods:
        assert pod["spec"]["nodeSelector"] == {"gpu.tessera.dev/model": "h100"}
        assert FLAVOR["spec"]["tolerations"][0] in pod["spec"]["tolerations"]
        assert EXAMPLE["spec"]["template"]["spec"]["tolerations"][0] in pod["spec"]["tolerations"]
    # the Workload asks for what the job asks, not the flavor's placement
    assert "nodeSelector" not in found.workload["spec"]["podSets"][0]["template"]["spec"]


def test_an_admission_whose_flavor_is_not_read_waits() -> None:
    job = _job()
    found = desired.desired(_spec(job), Observed(job, queue=Queue(ADMITTED)), NOW)
    assert "ResourceFlavor h100, which is not read yet" in \
        _conditions(found.status)["Suspended"]["message"]


def test_an_evicted_job_suspends_then_gives_its_quota_back_once_its_pods_are_gone() -> None:
    job = _job(attempt=0, restarts=0)
    spec = _spec(job)
    pods = (workload.rendezvous_pod(job, spec.whole),
            workload.trainer_pod(job, spec.whole, 0, "n0"),
            workload.trainer_pod(job, spec.whole, 1, "n1"))
    queue = Queue(PREEMPTED, {"h100": FLAVOR})
    stopping = desired.desired(spec, Observed(job, pods=pods, queue=queue), NOW)
    assert sorted(stopping.delete_pods) == sorted(p["metadata"]["name"] for p in pods)
    assert stopping.ended and stopping.status["attempt"] == 1
    assert not stopping.workload_status  # the quota is held while the pods run
    assert "Preempted: Preempted message" in _conditions(stopping.status)["Suspended"]["message"]

    job = _job(**stopping.status)
    released = desired.desired(_spec(job), Observed(job, queue=queue), NOW)
    test, conditions, remove = released.workload_status
    assert test == {"op": "test", "path": "/metadata/resourceVersion", "value": "7"}
    assert remove == {"op": "remove", "path": "/status/admission"}
    after = {c["type"]: (c["status"], c["reason"]) for c in conditions["value"]}
    assert after == {"QuotaReserved": ("False", "Pending"),
                     "Admitted": ("False", "NoReservation"),
                     "Evicted": ("True", "Preempted"), "Preempted": ("True", "InClusterQueue"),
                     "Requeued": ("True", "Preempted")}


def test_a_finished_job_marks_its_workload_finished_once() -> None:
    done = {"conditions": [{"type": "Complete", "status": "True", "reason": "StepsDone",
                            "message": "every trainer pod finished the job's steps",
                            "lastTransitionTime": "2026-12-07T07:59:00Z"}]}
    job = _job(**done)
    found = desired.desired(_spec(job), Observed(job, queue=Queue(ADMITTED)), NOW)
    assert found.workload is None
    _, conditions = found.workload_status
    finished = _conditions({"conditions": conditions["value"]})["Finished"]
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    marked = _workload(("Finished", "True", "Succeeded"), admitted=True)
    again = desired.desired(_spec(job), Observed(job, queue=Queue(marked)), NOW)
    assert not again.workload_status
