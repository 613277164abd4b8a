"""The operator closing the loop on a real kube-apiserver: a GPU cordoned with the real command ->
new layout, status and power targets; uncordoned -> back. It runs as its own service account
under the shipped RBAC, so every call it makes here is one that RBAC allows."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from opharness import ROOT, RunningOperator

from power_controller import channel
from power_controller.perf_model import PAPER
from power_controller.targets import PowerTarget, parse_object
from tessera_operator import cordon, uncordon

pytestmark = pytest.mark.operator

EXAMPLE = yaml.safe_load((ROOT / "manifests/examples/ntpjob-small.yaml").read_text())


def _example(name: str) -> dict[str, Any]:
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": name}
    return job


def _layout(op: RunningOperator, job: str) -> dict[str, Any]:
    cm = client.CoreV1Api(op.admin).read_namespaced_config_map(f"{job}-layout", op.namespace)
    return json.loads(cm.data["layout.json"])


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == kind)


def _watts(op: RunningOperator, node: str) -> dict[int, int]:
    """Every GPU's target watts on `node`, as the agent would read them ({}: no target)."""
    obj = channel.fetch(op.admin, node)
    if obj is None:
        return {}
    spec = obj["spec"]
    listed = {g["index"]: g["watts"] for g in spec["gpus"]}
    return {i: listed.get(i, spec["baseWatts"]) for i in range(8)}


def _phase_layout(op: RunningOperator, job: str) -> tuple[str | None, str | None]:
    status = op.status(job)
    return status.get("phase"), status.get("tpLayout")


def test_cordon_degrades_boosts_and_uncordon_restores(
    running_operator: RunningOperator, capsys: pytest.CaptureFixture[str]
) -> None:
    op, job = running_operator, "llama-8b-small"
    node_a, node_b = op.create_nodes(job, 2)
    op.create_job(_example(job))
    policy = EXAMPLE["spec"]["powerPolicy"]
    base, cap, budget = policy["baseCapWatts"], policy["boostCapWatts"], policy["rackBudgetWatts"]

    # Healthy: two TP8 replicas, one per node; every GPU at the base cap.
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Running", "8,8"), "Running 8,8")
    status = op.status(job)
    assert status["layoutGeneration"] == 1
    assert _condition(status, "Ready")["status"] == "True"
    assert _condition(status, "Degraded")["status"] == "False"
    first = _layout(op, job)
    assert first["generation"] == 1 and first["tpDegrees"] == [8, 8]
    assert {tuple(r["stages"][0]["gpus"]) for r in first["replicas"]} == {
        tuple(f"{n}/{i}" for i in range(8)) for n in (node_a, node_b)}
    for node in (node_a, node_b):
        assert set(_watts(op, node).values()) == {base}

    # GPU 3 of node A cordoned through the real command: its replica runs at TP 7.
    kubeconfig = ["--kubeconfig", str(op.admin_kubeconfig)]
    assert cordon.main([node_a, "3", *kubeconfig]) == 0
    assert "'' -> '3'" in capsys.readouterr().out
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "7,8"), "Degraded 7,8")
    status = op.status(job)
    assert status["layoutGeneration"] == 2
    reduced = next(r for r in status["replicas"] if r["tensorParallelSize"] == 7)
    assert reduced["failedGPUs"] == [f"{node_a}/3"] and reduced["powerBoosted"] is True
    assert _condition(status, "Degraded")["reason"] == "ReducedTensorParallelism"
    assert _condition(status, "PowerBoosted")["status"] == "True"
    second = _layout(op, job)
    assert second["generation"] == 2 and sorted(second["tpDegrees"]) == [7, 8]
    gpus = next(r["stages"][0]["gpus"] for r in second["replicas"]
                if r["tensorParallelSize"] == 7)
    assert sorted(gpus) == sorted(f"{node_a}/{i}" for i in range(8) if i != 3)

    # Power: even the ideal 8/7 slowdown needs more than the boost cap allows, and the rack
    # budget allows less still: the cordoned GPU drops to the minimum and the survivors share
    # what is left of the budget, equally, whole watts.
    assert PAPER.speedup(cap / base) < 8 / 7
    watts = op.wait(lambda: _watts(op, node_a), lambda w: w.get(3) == 200, "node A boosted")
    assert {w for i, w in watts.items() if i != 3} == {min(cap, (budget - 200) // 7)}
    assert base < (budget - 200) // 7 < cap
    assert sum(watts.values()) <= budget
    assert set(_watts(op, node_b).values()) == {base}

    # Running the command again changes nothing; uncordon brings the job back.
    assert cordon.main([node_a, "3", *kubeconfig]) == 0
    assert "nothing changed" in capsys.readouterr().out
    assert uncordon.main([node_a, "3", *kubeconfig]) == 0
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Running", "8,8"), "Running again")
    assert op.status(job)["layoutGeneration"] == 3
    assert _layout(op, job)["fingerprint"] == first["fingerprint"]
    op.wait(lambda: _watts(op, node_a), lambda w: set(w.values()) == {base}, "node A at base")

    events = client.CoreV1Api(op.admin).list_namespaced_event(
        op.namespace, field_selector=f"involvedObject.name={job}").items
    assert {"LayoutChanged", "ReducedTensorParallelism", "SurvivorsBoosted"} <= {
        e.reason for e in events}


def test_malformed_cordon_is_ignored_and_reported(running_operator: RunningOperator) -> None:
    op, job = running_operator, "malformed-cordon"
    node, _ = op.create_nodes(job, 2)
    client.CoreV1Api(op.admin).patch_node(  # as `kubectl annotate` would
        node, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": "two, 9,1"}}})
    op.create_job(_example(job))
    # GPU 1 is cordoned; "two" and 9 (the node has 8 GPUs) are ignored and said so.
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "7,8"), "Degraded 7,8")
    message = _condition(op.status(job), "Ready")["message"]
    assert "'two' is not a GPU index" in message and "GPU 9 does not exist" in message
    # The command refuses to edit a value it cannot read, rather than drop what is there.
    assert cordon.main([node, "2", "--kubeconfig", str(op.admin_kubeconfig)]) == 1


def test_spec_problems_become_conditions(running_operator: RunningOperator) -> None:
    op = running_operator
    # No node serves it yet: Pending.
    op.create_job(_example("no-nodes"))
    op.wait(lambda: op.status("no-nodes").get("phase"), lambda p: p == "Pending", "Pending")
    assert _condition(op.status("no-nodes"), "Ready")["reason"] == "NoGPUNodes"
    # TP 16 on 8-GPU nodes without an NVLink-domain label: no TP group fits in a domain.
    wide = _example("too-wide")
    wide["spec"] |= {"tensorParallelSize": 16, "dataParallelReplicas": 1}
    nodes = op.create_nodes("too-wide", 2)
    op.create_job(wide)
    op.wait(lambda: _condition(op.status("too-wide"), "Ready")["reason"]
            if op.status("too-wide") else None, lambda r: r == "DomainTooSmall", "DomainTooSmall")
    assert op.status("too-wide")["phase"] == "Pending"
    # Labelled as one NVLink domain, the same two nodes carry the TP16 group.
    for node in nodes:
        client.CoreV1Api(op.admin).patch_node(
            node, {"metadata": {"labels": {"nvidia.com/gpu.clique": "nvl16-a"}}})
    op.wait(lambda: _phase_layout(op, "too-wide"), lambda s: s == ("Running", "16"), "TP16")


def test_operator_never_hit_a_permission_error(running_operator: RunningOperator) -> None:
    log = Path(running_operator.log).read_text()
    assert "Forbidden" not in log and "403" not in log, log[-3000:]


def test_power_targets_are_renewed_before_they_go_stale(running_operator: RunningOperator) -> None:
    op, job = running_operator, "renewal"
    node, _ = op.create_nodes(job, 2)
    op.create_job(_example(job))

    def target() -> PowerTarget | None:
        obj = channel.fetch(op.admin, node)
        return parse_object(obj, node) if obj else None  # as the node's agent validates it

    first = op.wait(target, bool, "a power target")
    # Nothing changes: only the operator's timer re-publishes it (every 20 s, TTL 60 s).
    renewed = op.wait(target, lambda t: t.renew_time != first.renew_time, "renewal", timeout=35)
    assert 0 < (renewed.renew_time - first.renew_time).total_seconds() < first.ttl_s
    assert replace(renewed, renew_time=first.renew_time) == first


def test_deleting_a_job_returns_its_gpus_to_base(running_operator: RunningOperator) -> None:
    op, job = running_operator, "deleted"
    node, _ = op.create_nodes(job, 2)
    client.CoreV1Api(op.admin).patch_node(
        node, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": "0"}}})
    op.create_job(_example(job))
    op.wait(lambda: _watts(op, node), lambda w: w.get(1, 0) > 600, "boosted")
    client.CustomObjectsApi(op.admin).delete_namespaced_custom_object(
        "tessera.dev", "v1alpha1", op.namespace, "ntptrainingjobs", job)
    op.wait(lambda: _watts(op, node), lambda w: set(w.values()) == {600}, "base caps")
    # The operator's finalizer is gone with its work done: the job is really deleted.
    names = op.wait(lambda: {j["metadata"]["name"] for j in client.CustomObjectsApi(
        op.admin).list_namespaced_custom_object("tessera.dev", "v1alpha1", op.namespace,
                                                "ntptrainingjobs")["items"]},
        lambda n: job not in n, "job gone")
    assert job not in names


def test_jobs_outside_the_watched_namespace_are_left_alone(
    running_operator: RunningOperator, namespace: str
) -> None:
    op = running_operator
    elsewhere = RunningOperator(op.proc, op.log, namespace, op.admin, op.admin_kubeconfig)
    elsewhere.create_job(_example("elsewhere"))
    elsewhere.create_nodes("elsewhere", 2)
    # A job in the watched namespace, created after, is served: the node events were handled.
    op.create_nodes("here", 2)
    op.create_job(_example("here"))
    op.wait(lambda: _phase_layout(op, "here"), lambda s: s == ("Running", "8,8"), "here Running")
    assert "status" not in elsewhere.job("elsewhere")
    assert not client.CoreV1Api(op.admin).list_namespaced_config_map(namespace).items
