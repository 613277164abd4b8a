"""The simulated node itself: its Node object and Lease, GPU allocatable, the exporter, its
command line, and its pods' processes dying with it."""

from __future__ import annotations

import signal
import subprocess
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
from tessera_dev import probes
from tessera_dev.controlplane import launcher
from tessera_dev.simnode import dcgm

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"


def _families(page: str) -> set[str]:
    return {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE ")}


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
        with urllib.request.urlopen(f"http://{node.address}:9400/metrics", timeout=5) as page:
            text = page.read().decode()
        assert page.status == 200
        # the node serves its own GPUs under its name, in the generation it was started with
        expected = dcgm.render(gpus.snapshot(), hostname=node.name, generation="4.9")
        assert _families(text) == _families(expected)
        assert text.count(f'hostname="{node.name}"') == expected.count(f'hostname="{node.name}"')
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
