"""The local cluster behaves like a small GPU cluster: the real scheduler places GPU pods on the
simulated nodes, their processes run with the identity, addresses and GPUs a kubelet gives, the
shipped DaemonSet runs a power agent per node, faults act as hardware faults, and `tessera-dev down`
leaves nothing behind."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tessera_contracts import api, powertarget
from tessera_dev import install, paths, probes, processes
from tessera_dev.controlplane import cluster, launcher

pytestmark = pytest.mark.cluster

TESSERA = (sys.executable, "-m", "tessera_dev.cli")
# A container that reports what it was given, then holds its first GPU as a CUDA process holds
# /dev/nvidiaN, until it is killed.
HOLD_GPU = """
import json, os, socket, time
print(json.dumps({k: v for k, v in os.environ.items()
                  if k.startswith(("POD_", "NODE_", "NVIDIA_", "TESSERA_", "KUBERNETES_"))}),
      flush=True)
first = os.environ["NVIDIA_VISIBLE_DEVICES"].split(",")[0]
device = open(os.path.join(os.environ["TESSERA_SIM_DEVICES"], "nvidia" + first))
print("holding GPU", first, flush=True)
time.sleep(3600)
"""
ENV_FROM_POD = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
]


def gpu_pod(name: str, gpus: int, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{
            "name": "worker", "image": "tessera-trainer:0.1.0",
            "command": ["python", "-c", HOLD_GPU], "env": ENV_FROM_POD,
            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"metadata": {"name": name}, "spec": spec}


wait = functools.partial(probes.wait_for, timeout=60.0, interval=0.2)


def pod(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod:
    return core.read_namespaced_pod(name, namespace)


def log_lines(core: client.CoreV1Api, namespace: str, name: str) -> list[str]:
    return core.read_namespaced_pod_log(name, namespace).splitlines()


@pytest.fixture
def core(admin_api) -> client.CoreV1Api:
    return client.CoreV1Api(admin_api)


def test_gpu_pods_are_placed_by_free_gpus_and_see_what_a_kubelet_gives(
        local_cluster, core, namespace):
    node, prometheus = "gpu-node-0", local_cluster.prometheus
    # the power draw by either generation's name
    draw = '{__name__=~"DCGM_FI_DEV_POWER_USAGE|DCGM_FI_DEV_BOARD_POWER_WATTS"'
    wait("idle GPUs drawing nothing", lambda: _dcgm(prometheus, draw, node, ","),
         lambda got: got == dict.fromkeys(range(8), 0.0))
    core.create_namespaced_pod(namespace, gpu_pod("first", 8, node))
    core.create_namespaced_pod(namespace, gpu_pod("second", 8, node))
    # 1. the first runs on the node; the second waits with the scheduler's reason
    wait("the first pod Running", lambda: pod(core, namespace, "first").status.phase,
         lambda phase: phase == "Running")
    wait("its GPUs drawing power", lambda: _dcgm(prometheus, draw, node, ","),
         lambda got: len(got) == 8 and min(got.values()) > 0)
    reason = wait("the second pod reported unschedulable", lambda: [
        c.message for c in pod(core, namespace, "second").status.conditions or []
        if c.type == "PodScheduled" and c.reason == "Unschedulable"])
    assert "Insufficient nvidia.com/gpu" in reason[0]
    # 2. its process saw its name, pod IP, node and eight concrete GPUs (through `kubectl logs`)
    lines = wait("the pod's report in its log", lambda: log_lines(core, namespace, "first"),
                 lambda got: any(line.startswith("holding GPU") for line in got))
    env = json.loads(lines[0])
    first = pod(core, namespace, "first")
    assert env["POD_NAME"] == "first" and env["NODE_NAME"] == node
    assert env["POD_IP"] == first.status.pod_ip != first.status.host_ip
    node_ip = first.status.host_ip
    assert first.status.pod_ip.rsplit(".", 1)[0] == node_ip.rsplit(".", 1)[0]  # the node's /24
    assert sorted(map(int, env["NVIDIA_VISIBLE_DEVICES"].split(","))) == list(range(8))
    # 3. its GPUs are free again once it is gone, and the second pod takes them
    core.delete_namespaced_pod("first", namespace)
    second = wait("the second pod started on the freed GPUs",
                  lambda: pod(core, namespace, "second").status,
                  lambda status: status.phase != "Pending")
    assert second.phase == "Running", (second.reason, second.message)


def test_a_pod_calls_the_api_as_its_service_account_and_no_more(local_cluster, core, namespace):
    script = """
from kubernetes import client, config
config.load_incluster_config()
core = client.CoreV1Api()
print("own pod:", core.read_namespaced_pod(__import__("os").environ["POD_NAME"],
                                           __import__("os").environ["POD_NAMESPACE"]).metadata.name)
try:
    core.list_namespaced_secret(__import__("os").environ["POD_NAMESPACE"])
    print("secrets: allowed")
except client.ApiException as exc:
    print("secrets:", exc.status)
"""
    rbac = client.RbacAuthorizationV1Api(core.api_client)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]})
    core.create_namespaced_pod(namespace, {"metadata": {"name": "caller"}, "spec": {
        "serviceAccountName": "reader", "restartPolicy": "Never",
        "nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"},
        "containers": [{"name": "caller", "image": "tessera:0.1.0",
                        "command": ["python", "-c", script],
                        "env": [*ENV_FROM_POD, {"name": "POD_NAMESPACE", "valueFrom": {
                            "fieldRef": {"fieldPath": "metadata.namespace"}}}]}]}})
    done = wait("the caller pod Succeeded", lambda: pod(core, namespace, "caller"),
                lambda p: p.status.phase in ("Succeeded", "Failed"))
    lines = log_lines(core, namespace, "caller")
    assert done.status.phase == "Succeeded", lines
    assert "own pod: caller" in lines and "secrets: 403" in lines


def _dcgm(prometheus, metric: str, node: str, open_: str = "{") -> dict[int, float]:
    """GPU index -> value of `metric` on `node` (`metric` may open its own selector, then
    `open_` continues it)."""
    return {int(s.labels["gpu"]): s.value
            for s in prometheus.query(f'{metric}{open_}node="{node}"}}')}


@pytest.fixture
def installed() -> Iterator[tuple[cluster.Cluster, client.ApiClient]]:
    """A cluster of its own with Tessera installed as a user installs it (the shipped
    manifests, local overlay): its cluster-wide operator must not serve the session's jobs."""
    with launcher.ControlPlane.start(bin_dir=launcher.prebuilt()) as plane:
        running = cluster.Cluster.start(plane, cluster.node_specs(2, 8))
        try:
            applied = subprocess.run(
                ["kubectl", f"--kubeconfig={plane.kubeconfig}", "apply", "--server-side",
                 "-k", str(paths.repo_root() / "manifests" / "local")],
                capture_output=True, text=True, timeout=120)
            assert applied.returncode == 0, applied.stderr
            with plane.api_client() as api:
                yield running, api
        finally:
            running.stop()


def test_the_shipped_manifests_run_the_operator_and_a_power_agent_per_node(installed):
    own, admin_api = installed
    core = client.CoreV1Api(admin_api)
    nodes = sorted(own.nodes)
    # both operator replicas available (one leads, one stands by, both Ready), an agent per node
    install.wait(admin_api, len(nodes))
    agents = wait("one Ready power agent per node", lambda: [
        p for p in core.list_namespaced_pod(
            "tessera-system", label_selector="app.kubernetes.io/name=tessera-power-agent").items
        if p.spec.node_name in nodes and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])],
        lambda pods: sorted(p.spec.node_name for p in pods) == nodes, timeout=120)
    assert len({p.status.pod_ip for p in agents}) == len(nodes)
    # 2. a power target per node (what the operator publishes): every GPU to 600 W
    custom = client.CustomObjectsApi(admin_api)
    for node in nodes:
        target = powertarget.PowerTarget(node=node, rack=node, budget_w=8 * 600, base_w=600,
                                         rack_budget_w=8 * 600)
        custom.create_cluster_custom_object(api.GROUP, api.VERSION, api.POWER_TARGET_PLURAL,
                                            powertarget.to_object(target))
    # 3. the limit shows in both the node's DCGM exporter and the agent's metrics, as scraped
    #    by Prometheus from targets it discovered through the API
    prometheus = own.prometheus
    for node in nodes:
        wait(f"DCGM_FI_DEV_POWER_MGMT_LIMIT of {node} at 600 W",
             lambda n=node: _dcgm(prometheus, "DCGM_FI_DEV_POWER_MGMT_LIMIT", n),
             lambda got: got == dict.fromkeys(range(8), 600.0))
        wait(f"the agent of {node} reports 600 W",
             lambda n=node: _dcgm(prometheus, "tessera_gpu_power_limit_watts", n),
             lambda got: got == dict.fromkeys(range(8), 600.0))


def test_a_failed_gpu_kills_its_process_and_shows_its_xid(local_cluster, core, namespace):
    node = "gpu-node-1"
    core.create_namespaced_pod(namespace, gpu_pod("holder", 1, node))
    lines = wait("the holder holds its GPU", lambda: log_lines(core, namespace, "holder")
                 if pod(core, namespace, "holder").status.phase == "Running" else [],
                 lambda got: any(line.startswith("holding GPU") for line in got))
    gpu = int(lines[-1].split()[-1])
    failed = subprocess.run([*TESSERA, "fail-gpu", node, str(gpu), "--xid", "79",
                             "--data-dir", str(local_cluster.plane.data_dir)],
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 0, failed.stderr
    # the process died with the GPU (the kill itself is bounded by fail-gpu's own test)
    terminated = wait("the holder's container terminated", lambda: [
        s.state.terminated for s in pod(core, namespace, "holder").status.container_statuses
        or [] if s.state.terminated], timeout=30)
    assert terminated[0].exit_code != 0
    prometheus = local_cluster.prometheus
    # the last-XID gauge, by either generation's name (4.9 drops the trailing S)
    xid = wait("the XID on the exporter",
               lambda: _dcgm(prometheus, '{__name__=~"DCGM_FI_DEV_XID_ERRORS?"', node, ","),
               lambda got: got.get(gpu) == 79.0, timeout=30)
    assert all(v == 0 for g, v in xid.items() if g != gpu)
    # the device plugin's view: one GPU fewer to allocate, capacity unchanged
    wait("allocatable down to 7", lambda: core.read_node(node).status.allocatable["nvidia.com/gpu"],
         lambda got: got == "7")
    assert core.read_node(node).status.capacity["nvidia.com/gpu"] == "8"
    restored = subprocess.run([*TESSERA, "restore-gpu", node, str(gpu), "--data-dir",
                               str(local_cluster.plane.data_dir)],
                              capture_output=True, text=True, timeout=60)
    assert restored.returncode == 0, restored.stderr
    wait("allocatable back to 8", lambda: core.read_node(node).status.allocatable["nvidia.com/gpu"],
         lambda got: got == "8")


def _cluster_processes(marker: str) -> list[int]:
    """Processes whose command line or environment mentions `marker` (the cluster's data dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in text:
            found.append(int(entry.name))
    return found


def test_up_then_down_leaves_no_process_and_a_killed_node_goes_not_ready(tmp_path):
    """`tessera-dev up` as a user runs it, in a state dir of its own; one node is failed, then
    everything is stopped and the processes that carried the state dir are counted."""
    env = {**os.environ, "TESSERA_STATE_DIR": str(tmp_path)}
    up = subprocess.run([*TESSERA, "up", "--nodes", "2", "--gpus-per-node", "2"], env=env,
                        capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr
    data_dir = tmp_path / "controlplane"
    try:
        running = cluster.Cluster.load(data_dir)
        assert running is not None and running.is_running()
        # the control plane, two nodes, discovery and Prometheus: at least seven processes
        assert len(_cluster_processes(str(data_dir))) >= 7
        with running.plane.api_client() as api:
            core = client.CoreV1Api(api)
            # a pod running on a node: its process must not outlive `down` either
            core.create_namespaced_pod("default", gpu_pod("holder", 1, node="gpu-node-0"))
            wait("the pod holding its GPU", lambda: log_lines(core, "default", "holder")
                 if pod(core, "default", "holder").status.phase == "Running" else [],
                 lambda lines: "holding GPU 0" in lines, timeout=90)
            assert [pid for pid in _cluster_processes(str(data_dir))
                    if b"holding GPU" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        failed = subprocess.run([*TESSERA, "fail-node", "gpu-node-1", "--data-dir",
                                 str(data_dir)], capture_output=True, text=True, timeout=60)
        assert failed.returncode == 0, failed.stderr
        with running.plane.api_client() as api:
            core = client.CoreV1Api(api)
            wait("gpu-node-1 NotReady", lambda: [
                c.status for c in core.read_node("gpu-node-1").status.conditions
                if c.type == "Ready"], lambda got: got == ["Unknown"], timeout=90)
            assert [c.status for c in core.read_node("gpu-node-0").status.conditions
                    if c.type == "Ready"] == ["True"]
    finally:
        down = subprocess.run([*TESSERA, "down"], env=env, capture_output=True, text=True,
                              timeout=120)
    assert down.returncode == 0, down.stderr
    left = _cluster_processes(str(data_dir))
    assert left == [], [processes.command_line(pid) for pid in left]
    assert not data_dir.exists()
