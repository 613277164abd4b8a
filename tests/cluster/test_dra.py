"""DRA on the simulated nodes, with the real scheduler and controller-manager: each node publishes
its GPUs as NVIDIA's DRA driver does; a pod whose container names a claim made from a template
gets exactly the devices the scheduler allocated (another container of the pod none); a device
taint written by the node's driver (`tessera-dev fail-gpu --dra-taint`) keeps the scheduler from
allocating the device until `restore-gpu` clears it; and the pod's `allocatedResourcesStatus`
follows its devices' health. The claims' and slices' shapes are unit-checked below them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tessera_agents.power.sim_backend import SimBackend
from tessera_dev import cli, probes
from tessera_dev.controlplane import cluster
from tessera_dev.simnode import dra, faults

pytestmark = pytest.mark.dra

HANG_S = 120.0


@pytest.fixture
def pods_gone(admin_api: client.ApiClient, namespace: str) -> Iterator[None]:
    """The test's pods deleted, and gone, after it: the cluster's GPUs idle again for the next
    test."""
    yield
    core = client.CoreV1Api(admin_api)
    core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    probes.wait_for("the test's pods gone", lambda: core.list_namespaced_pod(namespace).items,
                    lambda left: not left, timeout=HANG_S)


def _free_gpu(running: cluster.Cluster, node: str) -> tuple[int, str]:
    """A GPU of `node` no process holds (other tests share the cluster), and its UUID."""
    directory = faults.node_dir(running.plane.data_dir, node)
    gpus = SimBackend(state_path=directory / faults.GPU_STATE).snapshot()
    free = [g for g in gpus if g.healthy and not faults.holders(
        faults.device_file(directory, g.index))]
    assert free, f"every GPU of {node} is held"
    return free[-1].index, free[-1].uuid


def _template(api: client.ApiClient, namespace: str, count: int,
              selector: str | None = None) -> str:
    name = f"gpus-{uuid.uuid4().hex[:6]}"
    exactly: dict[str, Any] = {"deviceClassName": dra.DEVICE_CLASS,
                               "allocationMode": "ExactCount", "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    client.ResourceV1Api(api).create_namespaced_resource_claim_template(namespace, {
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}}})
    return name


def _pod(api: client.ApiClient, namespace: str, template: str, node: str | None = None) -> str:
    """A pod of two containers, `trainer` naming the claim and `sidecar` not, each printing
    what NVIDIA_VISIBLE_DEVICES it sees."""
    name = f"dra-{uuid.uuid4().hex[:6]}"
    show = 'echo "visible=${NVIDIA_VISIBLE_DEVICES-unset}"; exec sleep 3600'
    spec: dict[str, Any] = {
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {"name": "trainer", "image": "tessera:0.1.0", "command": ["sh", "-c", show],
             "resources": {"claims": [{"name": "gpus"}]}},
            {"name": "sidecar", "image": "tessera:0.1.0", "command": ["sh", "-c", show]}]}
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    client.CoreV1Api(api).create_namespaced_pod(namespace, {"metadata": {"name": name},
                                                           "spec": spec})
    return name


def _read(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return api.sanitize_for_serialization(
        client.CoreV1Api(api).read_namespaced_pod(name, namespace))


def _running(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return probes.wait_for(f"pod {namespace}/{name} running", lambda: _read(
        api, namespace, name), lambda pod: pod["status"].get("phase") == "Running" and all(
            "running" in (c.get("state") or {}) for c in pod["status"].get(
                "containerStatuses") or [{}]), timeout=HANG_S)


def _allocation(api: client.ApiClient, namespace: str, pod: dict[str, Any]) -> list[dict]:
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = client.ResourceV1Api(api).read_namespaced_resource_claim(
        status["resourceClaimName"], namespace)
    return api.sanitize_for_serialization(claim)["status"]["allocation"]["devices"]["results"]


def _visible(api: client.ApiClient, namespace: str, pod: str, container: str) -> str:
    said = probes.wait_for(f"{container}'s line", lambda: client.CoreV1Api(
        api).read_namespaced_pod_log(pod, namespace, container=container), timeout=HANG_S)
    return said.split("visible=", 1)[1].split()[0]


def _health(pod: dict[str, Any]) -> dict[str, str]:
    (trainer,) = (c for c in pod["status"]["containerStatuses"] if c["name"] == "trainer")
    (entry,) = trainer["allocatedResourcesStatus"]
    assert entry["name"] == "claim:gpus"
    return {r["resourceID"]: r["health"] for r in entry["resources"]}


def test_each_node_publishes_its_gpus_as_nvidias_driver_does(
        admin_api: client.ApiClient, local_cluster: cluster.Cluster) -> None:
    slices = client.ResourceV1Api(admin_api).list_resource_slice().items
    published = {s.spec.node_name: admin_api.sanitize_for_serialization(s) for s in slices
                 if s.spec.driver == dra.DRIVER}
    assert set(published) == set(local_cluster.nodes)
    for node, found in published.items():
        gpus = SimBackend(state_path=faults.node_dir(local_cluster.plane.data_dir, node)
                          / faults.GPU_STATE).snapshot()
        assert found["spec"]["pool"]["name"] == node
        devices = {d["name"]: d for d in found["spec"]["devices"]}
        assert sorted(devices) == sorted(f"gpu-{g.index}" for g in gpus)
        for gpu in gpus:
            attributes = devices[f"gpu-{gpu.index}"]["attributes"]
            assert attributes["uuid"] == {"string": gpu.uuid}
            assert attributes["type"] == {"string": "gpu"}
            assert attributes["productName"] == {"string": gpu.model_name}
    # the DeviceClass NVIDIA's driver installs selects them
    device_class = client.ResourceV1Api(admin_api).read_device_class(dra.DEVICE_CLASS)
    assert "device.driver == 'gpu.nvidia.com'" in device_class.spec.selectors[0].cel.expression


def test_a_container_naming_a_claim_sees_exactly_its_allocated_devices(
        admin_api: client.ApiClient, namespace: str, local_cluster: cluster.Cluster,
        pods_gone: None) -> None:
    template = _template(admin_api, namespace, count=3)
    name = _pod(admin_api, namespace, template)
    pod = _running(admin_api, namespace, name)
    results = _allocation(admin_api, namespace, pod)
    node = pod["spec"]["nodeName"]
    assert len(results) == 3 and {r["pool"] for r in results} == {node}
    assert {r["driver"] for r in results} == {dra.DRIVER}
    allocated = sorted(dra.device_index(r["device"]) for r in results)
    seen = _visible(admin_api, namespace, name, "trainer")
    assert sorted(map(int, seen.split(","))) == allocated
    assert _visible(admin_api, namespace, name, "sidecar") == "unset"
    assert _health(pod) == {f"{dra.DRIVER}/{node}/{r['device']}": "Healthy" for r in results}


def test_a_device_taint_keeps_the_scheduler_off_the_device_until_restored(
        admin_api: client.ApiClient, namespace: str, local_cluster: cluster.Cluster,
        pods_gone: None) -> None:
    node = "gpu-node-1"
    data_dir = str(local_cluster.plane.data_dir)
    index, gpu_uuid = _free_gpu(local_cluster, node)
    assert cli.main(["fail-gpu", node, str(index), "--xid", "48", "--dra-taint",
                     "--data-dir", data_dir]) == 0
    try:
        def taints() -> list[dict[str, Any]]:
            found = admin_api.sanitize_for_serialization(client.ResourceV1Api(
                admin_api).read_resource_slice(dra.slice_name(node)))
            (device,) = (d for d in found["spec"]["devices"] if d["name"] == f"gpu-{index}")
            return device.get("taints") or []

        (taint,) = probes.wait_for("the device taint", taints, timeout=HANG_S)
        assert (taint["key"], taint["value"], taint["effect"]) == (
            dra.XID_TAINT, "48", "NoSchedule")
        # a pod that wants that very device cannot be allocated it
        template = _template(admin_api, namespace, count=1, selector=(
            f"device.attributes['{dra.DRIVER}'].uuid == '{gpu_uuid}'"))
        name = _pod(admin_api, namespace, template, node=node)
        probes.wait_for("the scheduler's verdict", lambda: _read(admin_api, namespace, name),
                        lambda pod: "cannot allocate all claims" in next(
                            (c.get("message") or "" for c in pod["status"].get("conditions")
                             or [] if c["type"] == "PodScheduled"), ""), timeout=HANG_S)
    finally:
        assert cli.main(["restore-gpu", node, str(index), "--data-dir", data_dir]) == 0
    probes.wait_for("the taint gone", taints, lambda found: not found, timeout=HANG_S)
    pod = _running(admin_api, namespace, name)
    assert _visible(admin_api, namespace, name, "trainer") == str(index)
    assert pod["spec"]["nodeName"] == node


def test_the_pods_resource_health_follows_its_devices(
        admin_api: client.ApiClient, namespace: str, local_cluster: cluster.Cluster,
        pods_gone: None) -> None:
    node = "gpu-node-0"
    data_dir = str(local_cluster.plane.data_dir)
    index, gpu_uuid = _free_gpu(local_cluster, node)
    template = _template(admin_api, namespace, count=1, selector=(
        f"device.attributes['{dra.DRIVER}'].uuid == '{gpu_uuid}'"))
    name = _pod(admin_api, namespace, template, node=node)
    device = f"{dra.DRIVER}/{node}/gpu-{index}"
    assert _health(_running(admin_api, namespace, name)) == {device: "Healthy"}
    assert cli.main(["fail-gpu", node, str(index), "--data-dir", data_dir]) == 0
    try:
        probes.wait_for("the device reported unhealthy", lambda: _health(_read(
            admin_api, namespace, name)), lambda health: health == {device: "Unhealthy"},
            timeout=HANG_S)
    finally:
        assert cli.main(["restore-gpu", node, str(index), "--data-dir", data_dir]) == 0
    probes.wait_for("the device reported healthy again", lambda: _health(_read(
        admin_api, namespace, name)), lambda health: health == {device: "Healthy"},
        timeout=HANG_S)


# --- the pure part: what the kubelet makes of a pod's claims ---

def _claim(results: list[dict[str, str]] | None) -> dict[str, Any]:
    status = {} if results is None else {"allocation": {"devices": {"results": results}}}
    return {"metadata": {"name": "c"}, "status": status}


def test_only_this_nodes_devices_of_its_driver_are_taken_from_an_allocation() -> None:
    claim = _claim([
        {"request": "gpus", "driver": dra.DRIVER, "pool": "n0", "device": "gpu-2"},
        {"request": "gpus", "driver": dra.DRIVER, "pool": "n1", "device": "gpu-3"},
        {"request": "nic", "driver": "nic.example.com", "pool": "n0", "device": "gpu-4"},
        {"request": "gpus", "driver": dra.DRIVER, "pool": "n0", "device": "mig-1g.10gb-0"}])
    assert [(d.index, d.resource_id) for d in dra.allocated(claim, "n0")] == [
        (2, f"{dra.DRIVER}/n0/gpu-2")]
    with pytest.raises(dra.ClaimNotReady, match="not allocated yet"):
        dra.allocated(_claim(None), "n0")


def test_a_claim_from_a_template_waits_for_its_name_in_the_pods_status() -> None:
    pod = {"spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "t"},
                                       {"name": "shared", "resourceClaimName": "team-gpus"}]}}
    with pytest.raises(dra.ClaimNotReady, match="'gpus'"):
        dra.pod_claims(pod)
    pod["status"] = {"resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": "p-gpus"}]}
    assert dra.pod_claims(pod) == {"gpus": "p-gpus", "shared": "team-gpus"}


def test_a_container_sees_the_claims_and_requests_it_names_and_nothing_else() -> None:
    devices = {"gpus": [dra.Device("a", "gpu-0", 0, "x/0"), dra.Device("b/big", "gpu-1", 1,
                                                                       "x/1")],
               "other": [dra.Device("a", "gpu-5", 5, "x/5")]}
    whole = {"resources": {"claims": [{"name": "gpus"}]}}
    one = {"resources": {"claims": [{"name": "gpus", "request": "b"}]}}
    assert dra.container_devices(whole, devices) == [("claim:gpus", devices["gpus"])]
    assert dra.container_devices(one, devices) == [("claim:gpus/b", devices["gpus"][1:])]
    assert dra.container_devices({}, devices) == []
    assert dra.resource_health(dra.container_devices(whole, devices), healthy={1}) == [
        {"name": "claim:gpus", "resources": [{"resourceID": "x/0", "health": "Unhealthy"},
                                             {"resourceID": "x/1", "health": "Healthy"}]}]
