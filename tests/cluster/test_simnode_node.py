"""The simulated node itself: its Node object and Lease, GPU allocatable, its command line, and its
pods' processes dying with it; and the dcgm-exporter stand-in its exporter pod runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client
from nodeharness import (
    container_status,
    exited_within,
    node_argv,
    phase_in,
    pod_manifest,
    python,
    start_node,
    stop_node,
    wait_node,
    wait_pod,
)

from tessera_agents.power.sim_backend import SimBackend
from tessera_dev import probes, processes
from tessera_dev.controlplane import launcher
from tessera_dev.simnode import dcgm

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"


def _families(page: str) -> set[str]:
    return {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE ")}


def test_the_exporter_pod_serves_its_nodes_gpus_on_its_own_address(tmp_path: Path) -> None:
    """What a node runs for the dcgm-exporter image, in the environment the exporter pod gets:
    the node's shared GPU state under the node's name, in the node's generation, on the pod's
    address (DCGM_EXPORTER_LISTEN=:PORT names no host)."""
    gpus = SimBackend(count=2, node="gpu-node-7", state_path=tmp_path / "gpus.json")
    gpus.fail(1, 79)
    port = processes.free_ports(1)[0]
    env = os.environ | {"DCGM_EXPORTER_LISTEN": f":{port}", "POD_IP": "127.0.0.1",
                        "NODE_NAME": "gpu-node-7", "TESSERA_SIM_DCGM_GENERATION": "4.8",
                        "TESSERA_SIM_GPU_STATE": str(tmp_path / "gpus.json")}
    proc = subprocess.Popen([sys.executable, "-m", "tessera_dev.simnode.exporter"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        probes.poll_until(lambda: probes.responds(f"{url}/health"), timeout=30,
                          error=lambda _: AssertionError("the exporter never answered"))
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as page:
            text = page.read().decode()
        expected = dcgm.render(gpus.snapshot(), hostname="gpu-node-7", generation="4.8")
        assert _families(text) == _families(expected)
        assert 'DCGM_FI_DEV_XID_ERRORS{gpu="1"' in text and 'hostname="gpu-node-7"' in text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    # without the GPU state (a pod without runtimeClassName nvidia): one line, exit 1
    bad = subprocess.run([sys.executable, "-m", "tessera_dev.simnode.exporter"], timeout=60,
                         env={k: v for k, v in env.items() if k != "TESSERA_SIM_GPU_STATE"},
                         capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
    assert "TESSERA_SIM_GPU_STATE" in bad.stderr


def test_node_registers_heartbeats_and_reports_failed_gpus(
        control_plane: launcher.ControlPlane, admin_api: client.ApiClient,
        tmp_path: Path) -> None:
    node = start_node(control_plane, tmp_path, gpus=4)
    try:
        core = client.CoreV1Api(admin_api)
        seen = core.read_node(node.name)
        labels = seen.metadata.labels
        assert labels["nvidia.com/gpu.present"] == "true"
        assert labels["nvidia.com/gpu.count"] == "4"
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert labels["nvidia.com/gpu.memory"] == "143771"  # MiB, as GPU feature discovery says
        assert labels["nvidia.com/gpu.clique"] == f"test.{node.name}"
        assert labels["kubernetes.io/hostname"] == node.name
        assert seen.status.capacity[GPU] == seen.status.allocatable[GPU] == "4"
        assert {(a.type, a.address) for a in seen.status.addresses} == {
            ("InternalIP", node.address), ("Hostname", node.name)}
        ready = next(c for c in seen.status.conditions if c.type == "Ready")
        assert (ready.status, ready.reason) == ("True", "KubeletReady")
        # the node takes its Lease right after it reports Ready
        leases = client.CoordinationV1Api(admin_api)
        [lease] = probes.poll_until(lambda: leases.list_namespaced_lease(
            "kube-node-lease", field_selector=f"metadata.name={node.name}").items, timeout=30,
            error=lambda _: AssertionError("the node never took its Lease"))
        assert lease.spec.holder_identity == node.name
        assert lease.spec.lease_duration_seconds == 40
        # a failed GPU leaves allocatable (as the device plugin reports it); capacity stays
        gpus = SimBackend(state_path=node.dir / "gpus.json")
        gpus.fail(2, 79)
        failed = wait_node(admin_api, node.name,
                           lambda n: n["status"]["allocatable"][GPU] == "3")
        assert failed["status"]["capacity"][GPU] == "4"
        gpus.restore(2)
        wait_node(admin_api, node.name, lambda n: n["status"]["allocatable"][GPU] == "4")
        # the renewed lease moved on meanwhile
        renewed = client.CoordinationV1Api(admin_api).read_namespaced_lease(
            node.name, "kube-node-lease")
        assert renewed.spec.renew_time > lease.spec.renew_time
    finally:
        stop_node(node)


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--address", "10.0.0.1", "--address"),
    ("--address", "127.1.9.0", "--address"),
    ("--gpus", "-1", "--gpus"),
    ("--name", "Bad_Name", "--name"),
    ("--domain", "a b", "--domain"),
    ("--dir", "FILE", "--dir"),
    ("--kubeconfig", "FILE", "--kubeconfig"),
])
def test_bad_flags_exit_2_naming_the_flag(control_plane: launcher.ControlPlane, tmp_path: Path,
                                         flag: str, value: str, named: str) -> None:
    argv = node_argv(control_plane, tmp_path, "flagcheck", "127.1.9.1", 2)
    if value == "FILE":  # a file where the flag wants a directory, or not a kubeconfig
        value = str(tmp_path / "a-file")
        Path(value).write_text("not: [a kubeconfig")
    argv[argv.index(flag) + 1] = value
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert named in done.stderr and "Traceback" not in done.stderr


FAMILY = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "3600"])
me = os.readlink("/proc/self")  # the host's procfs names processes by their host pids
children = open(f"/proc/{me}/task/{me}/children").read().split()
print(me, *children, flush=True)
time.sleep(3600)
"""


def test_pod_processes_die_with_the_node(control_plane: launcher.ControlPlane,
                                         admin_api: client.ApiClient, namespace: str,
                                         tmp_path: Path) -> None:
    node = start_node(control_plane, tmp_path, gpus=1)
    try:
        pod = pod_manifest("family", node, python(FAMILY), container={
            "resources": {"limits": {GPU: "1"}}})
        client.CoreV1Api(admin_api).create_namespaced_pod(namespace, pod)
        running = wait_pod(admin_api, namespace, "family", phase_in("Running"))
        assert container_status(running)["ready"]
        # `kubectl logs -f`: the first line arrives once the process has written it
        stream = client.CoreV1Api(admin_api).read_namespaced_pod_log(
            "family", namespace, follow=True, _preload_content=False,
            _request_timeout=(10, 60))  # a line that never arrives fails, not hangs
        try:
            pids = [int(p) for p in stream.readline().split()]
        finally:
            stream.close()
        assert len(pids) == 2
        assert all(Path(f"/proc/{p}").exists() for p in pids)
        node.proc.send_signal(signal.SIGKILL)  # what `tessera-dev fail-node` does
        node.proc.wait()
        # the kernel ends the container's PID namespace with the node, grandchildren included
        assert all(exited_within(pid, 10) for pid in pids)
    finally:
        stop_node(node)
