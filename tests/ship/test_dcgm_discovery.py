"""DCGM as GPU clusters run it: the health agent finds its node's dcgm-exporter, a pod of the GPU
Operator's DaemonSet without host networking, through the EndpointSlices of Service
gpu-operator/nvidia-dcgm-exporter, and a GPU failing there changes a running job's layout.

On a local cluster of its own (2 simulated nodes x 2 GPUs) with Tessera installed from
manifests/local as a user installs it; the cluster runs the exporter as the GPU Operator does
(manifests/local-gpu-operator/dcgm-exporter.yaml)."""

from __future__ import annotations

import itertools
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from installharness import GPUS, HANG_S, NODES, ROOT, installed_cluster
from kubernetes import client

from tessera_agents.health import dcgm, discovery
from tessera_contracts.api import GPU_HEALTH_PLURAL, GROUP, JOB_PLURAL, VERSION
from tessera_dev import demo_data, probes
from tessera_dev.controlplane import launcher
from tessera_dev.simnode import faults

pytestmark = pytest.mark.ship

JOB = "dcgm-found"
LOST_NODE, LOST_GPU = "gpu-node-1", 1


@pytest.fixture(scope="module")
def installed() -> Iterator[tuple[launcher.ControlPlane, client.ApiClient]]:
    """A cluster of its own with Tessera installed from manifests/local, every power-agent pod
    ready (its health agent has published its node's GPUHealth)."""
    with installed_cluster() as (plane, api):
        yield plane, api


def _exporters(core: client.CoreV1Api) -> dict[str, Any]:
    pods = core.list_namespaced_pod("gpu-operator", label_selector="app=nvidia-dcgm-exporter")
    return {p.spec.node_name: p for p in pods.items}


def _health(api: client.ApiClient, node: str) -> dict[str, Any]:
    return client.CustomObjectsApi(api).get_cluster_custom_object(
        GROUP, VERSION, GPU_HEALTH_PLURAL, node)


def _agent_metrics(core: client.CoreV1Api, node: str) -> dict[str, float]:
    [pod] = [p for p in core.list_namespaced_pod(
        "tessera-system", label_selector="app.kubernetes.io/name=tessera-power-agent").items
        if p.spec.node_name == node]
    with urllib.request.urlopen(f"http://{pod.status.pod_ip}:9403/metrics", timeout=10) as page:
        text = page.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("tessera_health_")}


def test_the_agent_finds_the_exporter_pod_and_a_failed_gpu_changes_the_layout(
        installed: tuple[launcher.ControlPlane, client.ApiClient]) -> None:
    plane, api = installed
    core = client.CoreV1Api(api)

    # every node's exporter is a pod with an address of its own, not the node's
    exporters = _exporters(core)
    assert set(exporters) == {f"gpu-node-{k}" for k in range(NODES)}
    for node, pod in exporters.items():
        address = next(a.address for a in core.read_node(node).status.addresses
                       if a.type == "InternalIP")
        assert not pod.spec.host_network and pod.status.pod_ip != address, (node, address)

    # the health agent read it there: the GPUHealth names the pod's address
    for node, pod in exporters.items():
        url = f"http://{pod.status.pod_ip}:9400/metrics"
        health = probes.poll_until(
            lambda node=node: _health(api, node)["status"],
            lambda got, url=url: got["exporter"] == {"url": url}, timeout=HANG_S, interval=0.5,
            error=lambda got, url=url: AssertionError(f"the agent did not read {url}: {got}"))
        assert [g["state"] for g in health["gpus"]] == ["Healthy"] * GPUS, health
        metrics = _agent_metrics(core, node)
        assert metrics[f'tessera_health_exporter_up{{node="{node}"}}'] == 1.0, metrics
        assert metrics[f'tessera_health_gpus{{node="{node}",state="healthy"}}'] == GPUS

    # a tiny job, one TP2 replica per node, on synthetic data
    job = demo_data.without_dataset(yaml.safe_load(
        (ROOT / "manifests/examples/ntpjob-local.yaml").read_text()))
    job["metadata"] = {"name": JOB, "namespace": "default"}
    job["spec"] |= {"tensorParallelSize": GPUS, "gpusPerNode": GPUS, "totalGPUs": NODES * GPUS}
    job["spec"]["failurePolicy"]["minTensorParallelSize"] = 1
    job["spec"]["powerPolicy"]["rackBudgetWatts"] = GPUS * 500 + 200
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    jobs = client.CustomObjectsApi(api)
    jobs.create_namespaced_custom_object(GROUP, VERSION, "default", JOB_PLURAL, job)

    def status() -> dict[str, Any]:
        return jobs.get_namespaced_custom_object(
            GROUP, VERSION, "default", JOB_PLURAL, JOB).get("status") or {}

    probes.poll_until(status, lambda s: s.get("phase") == "Running" and s.get("tpLayout")
                      == f"{GPUS},{GPUS}", timeout=HANG_S, interval=0.5,
                      error=lambda s: AssertionError(f"job not running on TP{GPUS} x 2: {s}"))

    # the GPU falls off the bus: the exporter pod shows it, the agent publishes it, the
    # operator shrinks the replica on that node
    assert faults.fail_gpu([LOST_NODE, str(LOST_GPU), "--xid", "79",
                            "--data-dir", str(plane.data_dir)]) == 0
    probes.poll_until(status, lambda s: s.get("tpLayout") == f"{GPUS},{GPUS - 1}",
                      timeout=HANG_S, interval=0.5, error=lambda s: AssertionError(
                          f"layout unchanged after the GPU failed: {s}"))
    # the rank's death may change the layout first: DCGM's verdict follows on its read
    gpus = probes.poll_until(lambda: _health(api, LOST_NODE)["status"]["gpus"],
                             lambda g: g[LOST_GPU]["state"] == "Failed", timeout=HANG_S,
                             interval=0.5, error=lambda g: AssertionError(g))
    assert 79 in gpus[LOST_GPU]["xids"], gpus
    metrics = _agent_metrics(core, LOST_NODE)
    assert metrics[f'tessera_health_gpus{{node="{LOST_NODE}",state="failed"}}'] == 1, metrics
    assert metrics[f'tessera_health_exporter_up{{node="{LOST_NODE}"}}'] == 1.0, metrics


# --- without a cluster: the pure selection, the counters file -------------------------------

def _slice(*endpoints: dict[str, Any], port: int = 9400, name: str = "gpu-metrics"
           ) -> dict[str, Any]:
    return {"addressType": "IPv4", "ports": [{"name": name, "port": port, "protocol": "TCP"}],
            "endpoints": list(endpoints)}


def _endpoint(node: str, address: str, pod: str, ready: bool | None = True) -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": [address], "nodeName": node, "conditions": conditions,
            "targetRef": {"kind": "Pod", "name": pod}}


def test_the_endpoint_of_its_own_node_is_chosen_by_port_name_or_number() -> None:
    slices = [_slice(_endpoint("a", "10.0.0.5", "e-1"), _endpoint("b", "10.0.1.7", "e-2"))]
    for port in ("9400", "gpu-metrics"):
        assert discovery.exporter_url(slices, node="b", port=port) == \
            "http://10.0.1.7:9400/metrics"
    # a replaced pod: the ready successor, not the terminating one; absent `ready` is ready
    replaced = [_slice(_endpoint("b", "10.0.1.7", "e-2", ready=False)),
                _slice(_endpoint("b", "10.0.1.9", "e-3", ready=None))]
    assert discovery.exporter_url(replaced, node="b", port="9400") == \
        "http://10.0.1.9:9400/metrics"
    v6 = [{**_slice(_endpoint("b", "fd00::9", "e-2")), "addressType": "IPv6"}]
    assert discovery.exporter_url(v6, node="b", port="9400") == "http://[fd00::9]:9400/metrics"


@pytest.mark.parametrize(("slices", "why"), [
    ([], "no endpoint of Service nvidia-dcgm-exporter on node b"),
    ([_slice(_endpoint("a", "10.0.0.5", "e-1"))], "no endpoint .* on node b"),
    ([_slice(_endpoint("b", "10.0.0.5", "e-1"), name="other", port=9500)], "no TCP port '9400'"),
    ([_slice(_endpoint("b", "10.0.0.5", "e-1", ready=False))], "is not ready"),
    ([_slice(_endpoint("b", "not-an-ip", "e-1"))], "no TCP port|no endpoint"),
])
def test_no_usable_endpoint_is_one_clear_reason(slices: list[dict[str, Any]], why: str) -> None:
    with pytest.raises(discovery.NotFound, match=why):
        discovery.exporter_url(slices, node="b", port="9400")


def _exporter_pod(name: str, node: str, ip: str, ready: bool) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"ports": [
                {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]}]},
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_the_exporter_pod_on_its_node_is_chosen_from_pods() -> None:
    pods = [_exporter_pod("e-1", "a", "127.1.0.2", True),
            _exporter_pod("e-2", "b", "127.1.1.2", True)]
    for port in ("metrics", "9400"):
        assert discovery.exporter_url_from_pods(pods, node="b", port=port, selector="app=x") \
            == "http://127.1.1.2:9400/metrics"
    with pytest.raises(discovery.NotFound, match="not ready"):
        discovery.exporter_url_from_pods([_exporter_pod("e-2", "b", "127.1.1.2", False)],
                                         node="b", port="9400", selector="app=x")


@pytest.mark.hardening
def test_its_own_nodes_exporter_is_chosen_whatever_the_order() -> None:
    """Node b's agent among the exporters of three nodes, its own listed anywhere: the ready pod
    on b, never another node's, though those sort after it by name and address, nor b's
    terminating predecessor (not ready, sorting after it)."""
    pods = [_exporter_pod("e-a", "a", "127.1.0.9", True),
            _exporter_pod("e-b", "b", "127.1.1.2", True),
            _exporter_pod("e-b-old", "b", "127.1.1.8", False),
            _exporter_pod("e-c", "c", "127.1.2.9", True)]
    slices = [_slice(_endpoint("a", "10.0.0.9", "e-a")), _slice(_endpoint("b", "10.0.1.2", "e-b")),
              _slice(_endpoint("b", "10.0.1.8", "e-b-old", ready=False)),
              _slice(_endpoint("c", "10.0.2.9", "e-c"))]
    for order in itertools.permutations(range(4)):
        assert discovery.exporter_url_from_pods([pods[i] for i in order], node="b", port="9400",
                                                selector="app=x") == \
            "http://127.1.1.2:9400/metrics", order
        assert discovery.exporter_url([slices[i] for i in order], node="b", port="9400") == \
            "http://10.0.1.2:9400/metrics", order


def test_the_counters_file_turns_on_every_field_the_health_agent_reads() -> None:
    rows = [line.split(",")[0].strip() for line in
            (ROOT / "manifests/dcgm/tessera-counters.csv").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert len(rows) == len(set(rows))
    # one generation's name of the last XID (the file is for one exporter release)
    assert len(set(rows) & set(dcgm.LAST_XID_FAMILIES)) == 1, rows
    missing = dcgm.FAMILIES - set(dcgm.LAST_XID_FAMILIES) - set(rows)
    assert not missing, missing
