"""The operator closing the loop on a real kube-apiserver: a GPU cordoned with the real command ->
new layout, status and power targets; uncordoned -> back. It runs as its own service account
under the shipped RBAC, so every call it makes here is one that RBAC allows."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kubernetes import client, config
from opharness import ROOT, RunningOperator

from tessera_cli import cordon, uncordon
from tessera_contracts.api import CORDON_ANNOTATION
from tessera_contracts.powertarget import format_time, parse_object
from tessera_core.perf_model import PAPER
from tessera_dev import simnodes
from tessera_operator import cache, handlers, jobqueue, observe, power_targets, workload
from tessera_operator.health import GPU_HEALTH_STALE_AFTER_S

pytestmark = pytest.mark.operator

EXAMPLE = yaml.safe_load((ROOT / "manifests/examples/ntpjob-small.yaml").read_text())


def _example(name: str) -> dict[str, Any]:
    """The example job, placed on the nodes `create_nodes(name, ...)` makes."""
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] = {"name": name}
    simnodes.place_in_pool(job["spec"], name)
    return job


def _layout(op: RunningOperator, job: str) -> dict[str, Any]:
    """The generation document the job's trainers follow."""
    cm = client.CoreV1Api(op.admin).read_namespaced_config_map(f"{job}-layout", op.namespace)
    return json.loads(cm.data["generation.json"])


def _replica_gpus(document: dict[str, Any]) -> list[list[str]]:
    return [r["gpus"] for r in document["replicas"]]


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == kind)


def _watts(op: RunningOperator, node: str) -> dict[int, int]:
    """Every GPU's target watts on `node`, as the agent would read them ({}: no target)."""
    obj = power_targets.fetch(op.admin, node)
    if obj is None:
        return {}
    target = parse_object(obj, node)
    return {i: target.watts_for(i) for i in range(8)}


def _phase_layout(op: RunningOperator, job: str) -> tuple[str | None, str | None]:
    """The layout's state as the conditions say it (Running, Degraded, or Pending without
    one) and the TP degrees. No trainer runs on these nodes (they have no kubelet), so the job's
    phase itself stays Pending: it follows what the trainers report."""
    status = op.status(job)
    if not status.get("conditions"):
        return None, status.get("tpLayout")
    if _condition(status, "Ready")["status"] != "True":
        return "Pending", status.get("tpLayout")
    degraded = _condition(status, "Degraded")["status"] == "True"
    return ("Degraded" if degraded else "Running"), status.get("tpLayout")


def test_cordon_degrades_boosts_and_uncordon_restores(
    running_operator: RunningOperator, capsys: pytest.CaptureFixture[str]
) -> None:
    op, job = running_operator, "llama-8b-small"
    node_a, node_b = op.create_nodes(job, 2)
    op.create_job(_example(job))
    op.start_rendezvous(job)
    policy = EXAMPLE["spec"]["powerPolicy"]
    base, cap, budget = policy["baseCapWatts"], policy["boostCapWatts"], policy["rackBudgetWatts"]

    # Healthy: two TP8 replicas, one per node; every GPU at the base cap.
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Running", "8,8"), "Running 8,8")
    # Published once the rendezvous pod has its address (its watch brings the job back).
    status = op.wait(lambda: op.status(job), lambda s: s.get("layoutGeneration") == 1,
                     "generation 1 published")
    assert _condition(status, "Ready")["status"] == "True"
    assert _condition(status, "Degraded")["status"] == "False"
    first = _layout(op, job)
    assert (first["kind"], first["generation"]) == ("NTPGeneration", 1)
    assert {tuple(gpus) for gpus in _replica_gpus(first)} == {
        tuple(f"{n}/{i}" for i in range(8)) for n in (node_a, node_b)}
    assert first["model"]["hidden"] == EXAMPLE["spec"]["model"]["hidden"]
    assert first["mode"] == EXAMPLE["spec"]["failurePolicy"]["mode"]
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
    assert second["generation"] == 2
    # Each later generation is server-side applied under the operator's field manager.
    fields = client.CoreV1Api(op.admin).read_namespaced_config_map(
        f"{job}-layout", op.namespace).metadata.managed_fields
    assert ("tessera-operator", "Apply") in {(f.manager, f.operation) for f in fields}
    gpus = next(g for g in _replica_gpus(second) if len(g) == 7)
    assert sorted(gpus) == sorted(f"{node_a}/{i}" for i in range(8) if i != 3)
    # A drain: every process on a GPU that stays carries on (origin), the switch is planned.
    kept = {g: r for r, g in enumerate(x for gs in _replica_gpus(first) for x in gs)}
    assert second["origin"] == [kept[g] for gs in _replica_gpus(second) for g in gs]
    assert second["atStep"] == 0  # no trainer has reported a step

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
    assert _replica_gpus(_layout(op, job)) == _replica_gpus(first)
    op.wait(lambda: _watts(op, node_a), lambda w: set(w.values()) == {base}, "node A at base")

    events = client.CoreV1Api(op.admin).list_namespaced_event(
        op.namespace, field_selector=f"involvedObject.name={job}").items
    assert {"LayoutChanged", "ReducedTensorParallelism", "SurvivorsBoosted"} <= {
        e.reason for e in events}


def _publish_health(op: RunningOperator, node: str, gpus: dict[int, dict[str, Any]],
                    observed: datetime) -> None:
    """The node's GPUHealth as its health agent writes it: every GPU Healthy unless `gpus`
    says otherwise (index -> the entry's fields)."""
    entries = [{"index": i, "state": "Healthy", "xids": [], "reason": ""} | gpus.get(i, {})
               for i in range(8)]
    body = {"apiVersion": "tessera.dev/v1alpha1", "kind": "GPUHealth",
            "metadata": {"name": node},
            "status": {"observedAt": format_time(observed), "exporter": {"url": "http://x"},
                       "gpus": entries}}
    api = client.CustomObjectsApi(op.admin)
    try:
        current = api.get_cluster_custom_object("tessera.dev", "v1alpha1", "gpuhealths", node)
    except client.ApiException as exc:
        assert exc.status == 404
        api.create_cluster_custom_object("tessera.dev", "v1alpha1", "gpuhealths", body)
        return
    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    api.replace_cluster_custom_object("tessera.dev", "v1alpha1", "gpuhealths", node, body)


def test_a_failed_gpu_stays_out_while_its_health_is_unknown(running_operator: RunningOperator
                                                            ) -> None:
    """DCGM fails GPU 3 (XID 79); then its health can no longer be told (its series vanish,
    then the node's health agent stops publishing): the layout keeps it out rather than
    planning a dead GPU back in, and takes it back once it is reported healthy."""
    op, job = running_operator, "dcgm-unknown"
    node_a, node_b = op.create_nodes(job, 2)
    now = datetime.now(UTC)
    for node in (node_a, node_b):
        _publish_health(op, node, {}, now)
    op.create_job(_example(job))
    op.start_rendezvous(job)
    op.wait(lambda: op.status(job).get("layoutGeneration"), lambda g: g == 1, "generation 1")
    try:
        _publish_health(op, node_a, {3: {"xids": [79]}}, now)
        op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "7,8"), "7,8")
        assert f"{node_a}/3" not in {g for gs in _replica_gpus(_layout(op, job)) for g in gs}
        assert "atStep" not in _layout(op, job)  # lost under its process: not planned
        # Off the bus, the GPU's series vanish: unknown, not healthy.
        _publish_health(op, node_a, {3: {"state": "Unknown", "reason": "no health series"}},
                        now)
        held = "GPUs 3 stay out of the layout while their health is unknown"
        op.wait(lambda: _condition(op.status(job), "Ready")["message"], lambda m: held in m,
                "held out")
        assert (op.status(job)["layoutGeneration"], op.status(job)["tpLayout"]) == (2, "7,8")
        # The whole node's health goes stale (its agent stopped publishing long ago).
        _publish_health(op, node_a, {3: {"xids": [79]}},
                        now - timedelta(seconds=GPU_HEALTH_STALE_AFTER_S + 60))
        op.wait(lambda: _condition(op.status(job), "Ready")["message"],
                lambda m: "published" in m and "ago" in m, "stale health noted")
        assert held in _condition(op.status(job), "Ready")["message"]
        assert (op.status(job)["layoutGeneration"], op.status(job)["tpLayout"]) == (2, "7,8")
        # Reported healthy again: GPU 3 rejoins.
        _publish_health(op, node_a, {}, datetime.now(UTC))
        op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Running", "8,8"), "8,8 again")
        assert op.status(job)["layoutGeneration"] == 3
    finally:
        for node in (node_a, node_b):
            client.CustomObjectsApi(op.admin).delete_cluster_custom_object(
                "tessera.dev", "v1alpha1", "gpuhealths", node)


def test_a_gpu_lost_under_its_process_is_planned_at_the_limit_its_agent_reports(
        running_operator: RunningOperator) -> None:
    """DCGM fails GPU 3 (XID 79): its agent can no longer cut it and counts it at the limit it
    last set, which it reports. The operator plans it there, so node A's survivors are asked for
    what the budget holds beyond it, not for watts that a cut to the minimum would have freed
    (the agent could not fund those)."""
    op, job = running_operator, "dcgm-power"
    node_a, node_b = op.create_nodes(job, 2)
    now = datetime.now(UTC)
    for node in (node_a, node_b):
        _publish_health(op, node, {}, now)
    body = _example(job)
    power = body["spec"]["powerPolicy"]
    base, cap = power["baseCapWatts"], power["boostCapWatts"]
    budget = power["rackBudgetWatts"] = 8 * base + 400  # room to boost beyond the lost GPU
    op.create_job(body)
    op.start_rendezvous(job)
    op.wait(lambda: op.status(job).get("layoutGeneration"), lambda g: g == 1, "generation 1")
    last = base + 40  # the limit node A's agent last set on GPU 3
    client.CustomObjectsApi(op.admin).patch_cluster_custom_object_status(
        "tessera.dev", "v1alpha1", "gpupowertargets", node_a, {"status": {"gpus": [
            {"index": i, "limitWatts": last if i == 3 else base} for i in range(8)]}})
    try:
        _publish_health(op, node_a, {3: {"xids": [79]}}, now)
        op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "7,8"), "7,8")
        watts = op.wait(lambda: _watts(op, node_a), lambda w: w.get(3) == last,
                        "the lost GPU planned at its reported limit")
        survivors = {watts[i] for i in range(8) if i != 3}
        assert survivors == {min(cap, (budget - last) // 7)}, watts
        assert base < min(survivors) < cap  # boosted, within what the budget holds beyond it
        assert sum(watts.values()) <= _budget(op, node_a) <= budget
        assert _condition(op.status(job), "PowerBoosted")["status"] == "True"
        # A cordon, by contrast, is cut by its agent: the drained GPU goes to the minimum.
        assert cordon.main([node_a, "5", "--kubeconfig", str(op.admin_kubeconfig)]) == 0
        watts = op.wait(lambda: _watts(op, node_a), lambda w: w.get(5) == 200, "5 drained")
        assert watts[3] == last
    finally:
        for node in (node_a, node_b):
            client.CustomObjectsApi(op.admin).delete_cluster_custom_object(
                "tessera.dev", "v1alpha1", "gpuhealths", node)


def test_a_restart_waiting_for_a_healthy_node_is_placed_when_a_gpu_is_healthy_again(
        running_operator: RunningOperator) -> None:
    """CKPT-RESTART places an attempt only on nodes none of whose GPUs fail: with one of its two
    nodes failed by DCGM the job waits, Unschedulable. The GPU reported healthy again changes
    no node object, only that node's GPUHealth, and no pod of the job is on it: that event alone
    places the job."""
    op, job = running_operator, "ckpt-waits"
    node_a, node_b = op.create_nodes(job, 2)
    now = datetime.now(UTC)
    _publish_health(op, node_a, {3: {"xids": [79]}}, now)
    _publish_health(op, node_b, {}, now)
    body = _example(job)
    body["spec"]["failurePolicy"] = {"mode": "CKPT-RESTART"}
    del body["spec"]["powerPolicy"]
    try:
        op.create_job(body)
        ready = op.wait(lambda: _condition(op.status(job), "Ready") if op.status(job) else {},
                        lambda c: c.get("reason") == "Unschedulable", "waiting for a node")
        assert "a node with a failed or cordoned GPU is no candidate (1 such)" in \
            ready["message"], ready
        assert not _children(op, job).get("pods")
        _publish_health(op, node_a, {}, datetime.now(UTC))
        pods = op.wait(lambda: client.CoreV1Api(op.admin).list_namespaced_pod(
            op.namespace, label_selector=f"tessera.dev/job={job},tessera.dev/role=trainer").items,
            lambda found: len(found) == 2, "both trainer pods placed")
        assert {workload.pod_node(op.admin.sanitize_for_serialization(p)) for p in pods} \
            == {node_a, node_b}
    finally:
        for node in (node_a, node_b):
            client.CustomObjectsApi(op.admin).delete_cluster_custom_object(
                "tessera.dev", "v1alpha1", "gpuhealths", node)


def test_a_node_that_stops_reporting_is_planned_without_at_once(running_operator: RunningOperator
                                                                ) -> None:
    """Its kubelet silent (the node lifecycle controller's Ready Unknown, NodeStatusUnknown):
    whatever ran there is gone, so the job goes on without the node in an unplanned generation,
    which the other nodes' agents take as the end of the one their ranks are in."""
    op, job = running_operator, "node-lost"
    node_a, node_b = op.create_nodes(job, 2)
    op.create_job(_example(job))
    op.start_rendezvous(job)
    op.wait(lambda: op.status(job).get("layoutGeneration"), lambda g: g == 1, "generation 1")
    now = format_time(datetime.now(UTC))
    client.CoreV1Api(op.admin).patch_node_status(node_b, {"status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
         "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": now,
         "lastTransitionTime": now}]}})
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "8"), "Degraded 8")
    second = _layout(op, job)
    assert second["generation"] == 2 and "atStep" not in second
    assert _replica_gpus(second) == [[f"{node_a}/{i}" for i in range(8)]]
    assert f"node {node_b}: its kubelet stopped reporting" in _condition(
        op.status(job), "Ready")["message"]


def test_malformed_cordon_is_ignored_and_reported(
    running_operator: RunningOperator, capsys: pytest.CaptureFixture[str]
) -> None:
    op, job = running_operator, "malformed-cordon"
    node, _ = op.create_nodes(job, 2)
    huge = "7" * 5000  # past Python's limit for parsing an integer
    client.CoreV1Api(op.admin).patch_node(  # as `kubectl annotate` would
        node, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": f"two, 9,1,{huge}"}}})
    op.create_job(_example(job))
    # GPU 1 is cordoned; "two", 9 (the node has 8 GPUs) and the huge one are ignored, said so.
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "7,8"), "Degraded 7,8")
    message = _condition(op.status(job), "Ready")["message"]
    assert "'two' is not a GPU index" in message and "GPU 9 does not exist" in message
    assert "GPU 77777777...(5000 characters) does not exist" in message
    # The job keeps following its nodes: GPU 1 given back through the annotation.
    client.CoreV1Api(op.admin).patch_node(
        node, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": f"two,{huge}"}}})
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Running", "8,8"), "Running 8,8")
    # The command refuses to edit a value it cannot read, rather than drop what is there.
    assert cordon.main([node, "2", "--kubeconfig", str(op.admin_kubeconfig)]) == 1
    assert "is malformed" in capsys.readouterr().err


def _children(op: RunningOperator, job: str) -> dict[str, list[str]]:
    """Every object the operator makes for a job, by kind (each carries the job's label), and
    the pods among them not being deleted yet (these nodes have no kubelet to end them)."""
    selector = f"tessera.dev/job={job}"
    core, rbac = client.CoreV1Api(op.admin), client.RbacAuthorizationV1Api(op.admin)
    found = {
        "pods": [p.metadata.name for p in core.list_namespaced_pod(
            op.namespace, label_selector=selector).items if not p.metadata.deletion_timestamp],
        "configmaps": [c.metadata.name for c in core.list_namespaced_config_map(
            op.namespace, label_selector=selector).items],
        "serviceaccounts": [a.metadata.name for a in core.list_namespaced_service_account(
            op.namespace, label_selector=selector).items],
        "roles": [r.metadata.name for r in rbac.list_namespaced_role(
            op.namespace, label_selector=selector).items],
        "rolebindings": [b.metadata.name for b in rbac.list_namespaced_role_binding(
            op.namespace, label_selector=selector).items],
        "gpupowertargets": [t["metadata"]["name"] for t in client.CustomObjectsApi(
            op.admin).list_cluster_custom_object(
                power_targets.GROUP, power_targets.VERSION, power_targets.PLURAL,
                                                 label_selector=selector)["items"]],
    }
    return {kind: names for kind, names in found.items() if names}


def test_spec_problems_become_conditions(running_operator: RunningOperator) -> None:
    op = running_operator
    # No node it may be placed on: Pending, and nothing created half-way.
    op.create_job(_example("no-nodes"))
    op.wait(lambda: op.status("no-nodes").get("phase"), lambda p: p == "Pending", "Pending")
    assert _condition(op.status("no-nodes"), "Ready")["reason"] == "Unschedulable"
    assert _children(op, "no-nodes") == {}
    # One node where two are needed: the same.
    op.create_nodes("no-nodes", 1)
    op.wait(lambda: _condition(op.status("no-nodes"), "Ready")["message"],
            lambda m: "found 1 such nodes" in m, "one node found")
    assert _children(op, "no-nodes") == {}
    # Pipeline parallelism is in the schema, not in the trainer yet: refused, nothing made.
    staged = _example("pipelined")
    staged["spec"] |= {"pipelineParallelSize": 2, "dataParallelReplicas": 1}
    op.create_nodes("pipelined", 2)
    op.create_job(staged)
    ready = op.wait(lambda: _condition(op.status("pipelined"), "Ready")
                    if op.status("pipelined") else {}, lambda c: bool(c), "a condition")
    assert (ready["status"], ready["reason"]) == ("False", "PipelineParallelNotSupported")
    assert "pipelineParallelSize 2" in ready["message"]
    assert op.status("pipelined")["phase"] == "Pending"
    assert _children(op, "pipelined") == {}
    # TP 16 on 8-GPU nodes without an NVLink-domain label: no TP group fits in a domain, so
    # the job is not placed.
    wide = _example("too-wide")
    wide["spec"] |= {"tensorParallelSize": 16, "dataParallelReplicas": 1}
    nodes = op.create_nodes("too-wide", 2)
    op.create_job(wide)
    op.wait(lambda: _condition(op.status("too-wide"), "Ready")["message"]
            if op.status("too-wide") else "", lambda m: "in 2 domains" in m, "Unschedulable")
    assert "whole TP groups of 16 GPUs inside one scale-up domain" in _condition(
        op.status("too-wide"), "Ready")["message"]
    assert op.status("too-wide")["phase"] == "Pending"
    # Labelled as one NVLink domain, the same two nodes carry the TP16 group.
    for node in nodes:
        client.CoreV1Api(op.admin).patch_node(
            node, {"metadata": {"labels": {"nvidia.com/gpu.clique": "nvl16-a"}}})
    op.wait(lambda: _phase_layout(op, "too-wide"), lambda s: s == ("Running", "16"), "TP16")


def test_a_job_that_does_not_fit_its_gpus_memory_gets_no_pod(running_operator: RunningOperator
                                                             ) -> None:
    """Each replica's 32 sequences of 8,192 tokens in one pass, on nodes labelled as H100s the
    way GPU feature discovery labels them: FitsMemory=False with the layout and the numbers, and
    nothing made. One sequence a pass fits: the same job is then placed."""
    op, job = running_operator, "too-big"
    # Labelled at creation, as GPU feature discovery has labelled a node before any job needs
    # it: a label patched on afterwards may reach the operator after the job does.
    op.create_nodes(job, 2, labels={"nvidia.com/gpu.memory": "81559"})
    body = _example(job)
    del body["spec"]["gpuMemory"], body["spec"]["microBatchSize"]
    op.create_job(body)
    fits = op.wait(lambda: next((c for c in op.status(job).get("conditions", [])
                                 if c["type"] == "FitsMemory"), {}), bool, "FitsMemory")
    assert (fits["status"], fits["reason"]) == ("False", "MemoryDoesNotFit"), fits
    found = re.fullmatch(r"does not fit: layout 8,8 needs ([\d.]+) GiB on rank \d of replica \d "
                         r"\(TP 8\) for a training step, ([\d.]+) GiB usable of 79\.6 GiB per "
                         r"GPU \(79\.6 GiB from node gpu-[\w-]+'s nvidia\.com/gpu\.memory label\)",
                         fits["message"])
    assert found and float(found[1]) > float(found[2]), fits["message"]
    assert _condition(op.status(job), "Ready")["reason"] == "MemoryDoesNotFit"
    assert _children(op, job) == {}
    client.CustomObjectsApi(op.admin).patch_namespaced_custom_object(
        "tessera.dev", "v1alpha1", op.namespace, "ntptrainingjobs", job,
        {"spec": {"microBatchSize": 1}})
    op.wait(lambda: (_condition(op.status(job), "FitsMemory")["reason"],
                     len(_children(op, job).get("pods", []))), lambda seen: seen == ("Fits", 3),
            "FitsMemory=True, the rendezvous and two trainer pods")


def test_operator_never_hit_a_permission_error(running_operator: RunningOperator) -> None:
    log = Path(running_operator.log).read_text()
    # 403 as a status code, not as the milliseconds of a log line's time (",403]")
    assert "Forbidden" not in log and not re.search(r"(?<![,\d])403(?!\d)", log), log[-3000:]


def test_power_targets_are_written_only_when_they_change(running_operator: RunningOperator) -> None:
    op, job = running_operator, "unchanged"
    node, _ = op.create_nodes(job, 2)
    op.create_job(_example(job))
    first = op.wait(lambda: power_targets.fetch(op.admin, node), bool, "a power target")
    # A reconcile that finds nothing to change in power (an edit of the job's steps triggers
    # one) leaves the target as it was: no renewal traffic.
    edited = client.CustomObjectsApi(op.admin).patch_namespaced_custom_object(
        "tessera.dev", "v1alpha1", op.namespace, "ntptrainingjobs", job,
        {"spec": {"steps": op.job(job)["spec"]["steps"] + 1}})
    op.wait(lambda: op.status(job).get("observedGeneration"),
            lambda g: g == edited["metadata"]["generation"], "the edit reconciled")
    after = power_targets.fetch(op.admin, node)
    assert after["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


def test_a_node_taken_from_a_job_loses_its_target(running_operator: RunningOperator) -> None:
    op, job = running_operator, "shrinking"
    node_a, node_b = op.create_nodes(job, 2)
    client.CoreV1Api(op.admin).patch_node(
        node_a, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": "0"}}})
    op.create_job(_example(job))
    op.wait(lambda: _watts(op, node_a), lambda w: w.get(1, 0) > 600, "node A boosted")
    # Node A leaves the cluster while boosted: nothing asks for its boost any more.
    client.CoreV1Api(op.admin).delete_node(node_a)
    op.wait(lambda: power_targets.fetch(op.admin, node_a), lambda t: t is None,
            "node A's target gone")
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "8"), "one replica left")
    assert set(_watts(op, node_b).values()) == {600}


def test_deleting_a_job_deletes_its_targets(running_operator: RunningOperator) -> None:
    """Deleted in the middle of a reconfiguration (a drain published, no trainer switched
    yet, survivors boosted): nothing of the job is left behind."""
    op, job = running_operator, "deleted"
    node, _ = op.create_nodes(job, 2)
    op.create_job(_example(job))
    op.start_rendezvous(job)
    op.wait(lambda: op.status(job).get("layoutGeneration"), lambda g: g == 1, "generation 1")
    made = _children(op, job)
    assert set(made) == {"pods", "configmaps", "serviceaccounts", "roles", "rolebindings",
                         "gpupowertargets"}, made
    client.CoreV1Api(op.admin).patch_node(
        node, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": "0"}}})
    op.wait(lambda: _layout(op, job)["generation"], lambda g: g == 2, "the drain published")
    op.wait(lambda: _watts(op, node), lambda w: w.get(1, 0) > 600, "boosted")
    client.CustomObjectsApi(op.admin).delete_namespaced_custom_object(
        "tessera.dev", "v1alpha1", op.namespace, "ntptrainingjobs", job)
    # Its pods, ConfigMaps and identity go with it (the garbage collector, by their owner
    # reference); its power targets are deleted by the operator.
    op.wait(lambda: _children(op, job), lambda c: c == {}, "nothing of the job left")
    # Deleted targets: each agent settles its GPUs at the base cap inside its last share.
    op.wait(lambda: power_targets.fetch(op.admin, node), lambda t: t is None, "target deleted")
    # Nothing holds the job: it is really deleted.
    names = op.wait(lambda: {j["metadata"]["name"] for j in client.CustomObjectsApi(
        op.admin).list_namespaced_custom_object("tessera.dev", "v1alpha1", op.namespace,
                                                "ntptrainingjobs")["items"]},
        lambda n: job not in n, "job gone")
    assert job not in names


def test_a_node_name_no_label_can_hold_is_its_own_domain(running_operator: RunningOperator) -> None:
    op, job = running_operator, "long-node-names"
    tag = uuid.uuid4().hex[:8]
    nodes = simnodes.register(op.admin, [f"{'n' * 60}-{tag}-{i}" for i in range(2)], job)
    client.CoreV1Api(op.admin).patch_node(
        nodes[0], {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": "0"}}})
    op.create_job(_example(job))
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "7,8"), "Degraded 7,8")
    # A reconcile syncs the targets before it writes the status: they are there already.
    watts = _watts(op, nodes[0])
    assert watts.get(1, 0) > 600, _condition(op.status(job), "Ready")["message"]
    assert sum(watts.values()) <= EXAMPLE["spec"]["powerPolicy"]["rackBudgetWatts"]


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
    assert "elsewhere-layout" not in {
        cm.metadata.name for cm in client.CoreV1Api(op.admin).list_namespaced_config_map(
            namespace).items}


def _ready_reason(op: RunningOperator, job: str) -> str | None:
    status = op.status(job)
    return _condition(status, "Ready")["reason"] if status.get("conditions") else None


def test_a_layout_configmap_it_does_not_own_is_left_alone(
    running_operator: RunningOperator,
) -> None:
    op, job = running_operator, "not-mine"
    core = client.CoreV1Api(op.admin)
    theirs = {"metadata": {"name": f"{job}-layout"}, "data": {"layout.json": "someone's"}}
    core.create_namespaced_config_map(op.namespace, theirs)
    op.create_nodes(job, 2)
    op.create_job(_example(job))
    op.start_rendezvous(job)
    op.wait(lambda: _ready_reason(op, job), lambda r: r == "LayoutNotOwned", "LayoutNotOwned")
    assert op.status(job)["phase"] == "Pending"
    kept = core.read_namespaced_config_map(f"{job}-layout", op.namespace)
    assert kept.data == theirs["data"] and not kept.metadata.owner_references
    # Its owner removes it; the next reconcile (an edit of the job's spec triggers one)
    # publishes.
    core.delete_namespaced_config_map(f"{job}-layout", op.namespace)
    client.CustomObjectsApi(op.admin).patch_namespaced_custom_object(
        "tessera.dev", "v1alpha1", op.namespace, "ntptrainingjobs", job,
        {"spec": {"steps": op.job(job)["spec"]["steps"] + 1}})
    # Ready comes with the plan; the layout follows once the rendezvous has its address.
    op.wait(lambda: (_phase_layout(op, job), op.status(job).get("layoutGeneration")),
            lambda s: s == (("Running", "8,8"), 1), "Running 8,8, generation 1 published")
    mine = client.CoreV1Api(op.admin).read_namespaced_config_map(f"{job}-layout", op.namespace)
    assert json.loads(mine.data["generation.json"])["generation"] == 1
    assert [r.uid for r in mine.metadata.owner_references] == [op.job(job)["metadata"]["uid"]]


def test_the_operator_can_write_only_what_it_owns(running_operator: RunningOperator) -> None:
    """Its own credentials, the shipped RBAC and admission policies: no ConfigMap outside its
    jobs' layouts (kube-system included), no adoption, no job spec."""
    op = running_operator
    assert op.operator_kubeconfig is not None
    core_admin = client.CoreV1Api(op.admin)
    core_admin.create_namespaced_config_map(
        op.namespace, {"metadata": {"name": "users-layout"}, "data": {"k": "v"}})
    job = "owned-check"
    op.create_nodes(job, 2)
    op.create_job(_example(job))
    op.start_rendezvous(job)
    op.wait(lambda: op.status(job).get("layoutGeneration"), lambda g: g == 1, "published")
    uid = op.job(job)["metadata"]["uid"]
    owner = {"apiVersion": "tessera.dev/v1alpha1", "kind": "NTPTrainingJob", "name": "users",
             "uid": uid, "controller": True}
    with config.new_client_from_config(str(op.operator_kubeconfig)) as api:
        core = client.CoreV1Api(api)
        system = core.read_namespaced_config_map("extension-apiserver-authentication",
                                                 "kube-system")  # reading is not writing
        system.data["x"] = "y"
        refused = {
            "kube-system ConfigMap": lambda: core.replace_namespaced_config_map(
                system.metadata.name, "kube-system", system),
            "create a ConfigMap no job controls": lambda: core.create_namespaced_config_map(
                op.namespace, {"metadata": {"name": "x-layout"}}),
            "adopt a user's ConfigMap": lambda: core.replace_namespaced_config_map(
                "users-layout", op.namespace,
                {"metadata": {"name": "users-layout", "ownerReferences": [owner]}}),
            "delete a ConfigMap no job controls": lambda: core.delete_namespaced_config_map(
                "users-layout", op.namespace),
            "change a job's spec": lambda: client.CustomObjectsApi(
                api).patch_namespaced_custom_object(
                "tessera.dev", "v1alpha1", op.namespace, "ntptrainingjobs", job,
                {"spec": {"steps": 7}}),
        }
        for what, attempt in refused.items():
            with pytest.raises(client.ApiException) as err:
                attempt()
            assert err.value.status == 403, (what, err.value.body)
        # What it needs stays allowed: its own layout, its job's metadata.
        layout = core.read_namespaced_config_map(f"{job}-layout", op.namespace)
        core.replace_namespaced_config_map(f"{job}-layout", op.namespace, layout)
        client.CustomObjectsApi(api).patch_namespaced_custom_object(
            "tessera.dev", "v1alpha1", op.namespace, "ntptrainingjobs", job,
            {"metadata": {"annotations": {"tessera.dev/probe": "1"}}})
    assert core_admin.read_namespaced_config_map("users-layout", op.namespace).data == {"k": "v"}


def test_a_rack_budget_no_target_can_carry_is_published_within_reach(
    running_operator: RunningOperator,
) -> None:
    """The schema's largest rackBudgetWatts on one node: its share is cut to what the GPUs can
    draw, so the API server accepts the target and the job runs boosted."""
    op, job = running_operator, "huge-budget"
    node, _ = op.create_nodes(job, 2)
    client.CoreV1Api(op.admin).patch_node(
        node, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": "0"}}})
    body = _example(job)
    body["spec"]["powerPolicy"]["rackBudgetWatts"] = 10_000_000
    op.create_job(body)
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "7,8"), "Degraded 7,8")
    cap = body["spec"]["powerPolicy"]["boostCapWatts"]

    def settled() -> dict[int, int]:
        # A first reconcile may have seen the node before its cordon: the target it wrote moves
        # on once its agent (played here) reports it in effect.
        _report_in_effect(op, node)
        return _watts(op, node)

    op.wait(settled, lambda w: w == {0: 200} | {i: cap for i in range(1, 8)}, "boosted")
    assert power_targets.fetch(op.admin, node)["spec"]["budgetWatts"] == 8 * cap


def _report_in_effect(op: RunningOperator, *nodes: str) -> None:
    """What each node's power agent reports once its GPUs are within its target's budget (the
    target as it is now; a report already made is not repeated)."""
    for node in nodes:
        obj = power_targets.fetch(op.admin, node)
        generation = obj["metadata"]["generation"]
        if (obj.get("status") or {}).get("appliedGeneration") != generation:
            client.CustomObjectsApi(op.admin).patch_cluster_custom_object_status(
                "tessera.dev", "v1alpha1", "gpupowertargets", node,
                {"status": {"observedGeneration": generation, "appliedGeneration": generation,
                            "state": "Applied"}})


def _budget(op: RunningOperator, node: str) -> int | None:
    obj = power_targets.fetch(op.admin, node)
    return obj["spec"]["budgetWatts"] if obj else None


def test_a_raise_across_a_rack_waits_for_the_cut_it_needs(
    running_operator: RunningOperator,
) -> None:
    """Two nodes of one NVLink domain share its budget: when one loses a GPU the other's share
    grows, and that raise goes out only once the first node's agent reports its cut in effect
    (the report is the event that triggers it)."""
    op, job = running_operator, "rack-of-two"
    tag = uuid.uuid4().hex[:6]
    node_a, node_b = simnodes.register(op.admin, [f"rack-{tag}-a", f"rack-{tag}-b"], job,
                                       domain_label="nvidia.com/gpu.clique", domain=f"nvl-{tag}")
    body = _example(job)
    body["spec"]["powerPolicy"]["rackBudgetWatts"] = budget = 9600
    op.create_job(body)
    # Joining a rack that spans nodes, each node first gets its entry target (GPUs at their
    # minimum), and its share once the agents report those in effect.
    op.wait(lambda: (_budget(op, node_a), _budget(op, node_b)), all, "entry targets")

    def agents_act() -> tuple[dict[int, int], dict[int, int]]:
        _report_in_effect(op, node_a, node_b)  # each new target applied, as the agents would
        return _watts(op, node_a), _watts(op, node_b)

    op.wait(agents_act, lambda w: set(w[0].values()) == set(w[1].values()) == {600},
            "base caps")
    _report_in_effect(op, node_a, node_b)
    client.CoreV1Api(op.admin).patch_node(
        node_a, {"metadata": {"annotations": {"tessera.dev/cordoned-gpus": "0"}}})
    op.wait(lambda: _phase_layout(op, job), lambda s: s == ("Degraded", "7,8"), "Degraded 7,8")
    # The reconcile cut node A (its failed GPU pays for the boost) and holds node B's raise.
    cut, held = _budget(op, node_a), _budget(op, node_b)
    assert cut < budget // 2 and held == budget // 2
    assert f"raises on {node_b} wait" in _condition(op.status(job), "PowerBoosted")["message"]
    _report_in_effect(op, node_a)
    raised = op.wait(lambda: _budget(op, node_b), lambda b: b > held, "node B raised")
    assert cut + raised <= budget
    op.wait(lambda: _condition(op.status(job), "PowerBoosted")["message"],
            lambda m: "wait" not in m, "the boost no longer said to wait")


def test_a_node_event_older_than_an_api_read_takes_nothing_back(admin_api: client.ApiClient
                                                                ) -> None:
    """A job placed on a node the watch has not delivered yet reads it from the API; the watch
    then delivers the node's creation, older than that read. Planning on it would take a cordon
    back for one reconcile (a layout and power targets that flap); a newer event is taken."""
    core = client.CoreV1Api(admin_api)
    (name,) = simnodes.register(admin_api, [f"gpu-{uuid.uuid4().hex[:6]}"], "event-order")
    created = admin_api.sanitize_for_serialization(core.read_node(name))
    cordoned = {"metadata": {"annotations": {CORDON_ANNOTATION: "0"}}}
    core.patch_node(name, cordoned)
    memo = kopf.Memo(nodes=cache.NodeCache(), queue=jobqueue.JobQueue())

    def cordon_seen() -> str | None:
        (node,) = observe.nodes(admin_api, memo.nodes, [name])
        return node["metadata"]["annotations"].get(CORDON_ANNOTATION)

    def deliver(kind: str, body: dict[str, Any]) -> None:
        asyncio.run(handlers.on_node(type=kind, name=name, body=kopf.Body(body), memo=memo,
                                     logger=logging.getLogger("test"), node_jobs={},
                                     gpu_health={}, children={}, held_gpus={}))

    try:
        assert cordon_seen() == "0"  # read from the API: not delivered yet
        deliver("ADDED", created)
        assert cordon_seen() == "0"
        uncordoned = core.patch_node(name, {"metadata": {"annotations": {CORDON_ANNOTATION: None}}})
        deliver("MODIFIED", admin_api.sanitize_for_serialization(uncordoned))
        assert cordon_seen() is None
    finally:
        core.delete_node(name)
