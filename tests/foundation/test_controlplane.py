"""The local control plane: kubectl works as admin, tokens work, and RBAC is really enforced."""

from __future__ import annotations

import argparse
import io
import json
import socket
import subprocess
import sys
import uuid

import pytest
from kubernetes import client
from rich.console import Console

from tessera_dev import probes, processes
from tessera_dev.controlplane import cluster, up

pytestmark = pytest.mark.foundation


def test_kubectl_talks_to_the_server_as_admin(control_plane):
    whoami = subprocess.run(
        ["kubectl", "--kubeconfig", str(control_plane.kubeconfig), "auth", "whoami", "-o",
         "jsonpath={.status.userInfo.groups}"], capture_output=True, text=True, timeout=60)
    assert whoami.returncode == 0, whoami.stderr
    assert "system:masters" in whoami.stdout


def test_the_scheduler_leaves_an_unplaceable_pod_pending_with_its_reason(admin_api, namespace):
    core = client.CoreV1Api(admin_api)
    pod = {"metadata": {"name": "trainer-0"},
           "spec": {"nodeSelector": {"tessera.dev/no-such-node": "x"},
                    "containers": [{"name": "trainer", "image": "busybox"}]}}
    core.create_namespaced_pod(namespace, pod)

    def unschedulable() -> list:
        stored = core.read_namespaced_pod("trainer-0", namespace)
        return [c for c in stored.status.conditions or []
                if c.type == "PodScheduled" and c.reason == "Unschedulable"]

    [condition] = probes.poll_until(unschedulable, timeout=30, error=lambda _: AssertionError(
        "the scheduler never reported the pod unschedulable"))
    assert "didn't match Pod's node affinity/selector" in condition.message or \
        "no nodes available" in condition.message
    # the ServiceAccount admission plugin gave it the namespace's default identity
    assert core.read_namespaced_pod("trainer-0", namespace).spec.service_account_name == "default"


def test_the_controller_manager_collects_garbage_and_finishes_namespace_deletion(admin_api):
    core = client.CoreV1Api(admin_api)
    name = f"t-gc-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    owner = core.create_namespaced_config_map(name, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(name, {"metadata": {
        "name": "owned", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap",
                                              "name": "owner", "uid": owner.metadata.uid}]}})
    core.delete_namespaced_config_map("owner", name)
    probes.poll_until(lambda: [c.metadata.name for c in core.list_namespaced_config_map(
        name, field_selector="metadata.name=owned").items], lambda left: not left, timeout=30,
        error=lambda _: AssertionError("the owned ConfigMap outlived its owner"))
    core.delete_namespace(name)
    probes.poll_until(lambda: [n.metadata.name for n in core.list_namespace(
        field_selector=f"metadata.name={name}").items], lambda left: not left, timeout=60,
        error=lambda _: AssertionError(f"namespace {name} never finished terminating"))


def _allowed(call):
    """call()'s result, or None while the API server still forbids it."""
    try:
        return call()
    except client.ApiException as exc:
        if exc.status != 403:
            raise
        return None


def test_service_account_token_is_subject_to_rbac(control_plane, admin_api, namespace):
    with control_plane.service_account_client(namespace, "worker") as worker:
        pods = client.CoreV1Api(worker)
        # 1. a fresh service account may not read pods
        with pytest.raises(client.ApiException) as err:
            pods.list_namespaced_pod(namespace)
        assert err.value.status == 403
        assert f"system:serviceaccount:{namespace}:worker" in err.value.body
        # 2. a Role bound to it lets it, so RBAC (not a blanket deny) made the decision
        rbac = client.RbacAuthorizationV1Api(admin_api)
        rbac.create_namespaced_role(namespace, {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": "worker-reads-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": namespace}]})
        # the authorizer sees new bindings through its informers, a moment after they are made
        assert probes.poll_until(lambda: _allowed(lambda: pods.list_namespaced_pod(namespace)),
                                 timeout=30, error=lambda _: AssertionError(
                                     "the Role binding never took effect")).items == []
        # 3. and only what the Role grants
        with pytest.raises(client.ApiException) as err:
            pods.create_namespaced_pod(namespace, {"metadata": {"name": "x"}, "spec": {
                "containers": [{"name": "x", "image": "busybox"}]}})
        assert err.value.status == 403


def test_private_keys_and_kubeconfigs_are_readable_by_their_owner_only(control_plane):
    secrets = [*control_plane.data_dir.glob("*kubeconfig"),
               *control_plane.data_dir.glob("pki/*.key")]
    names = {path.name for path in secrets}
    # the admin's and each component's kubeconfig; the CA, serving, admin, token and the
    # apiserver's kubelet-client keys, and each component's
    assert {"kubeconfig", "kube-scheduler.kubeconfig", "kube-controller-manager.kubeconfig",
            "ca.key", "apiserver.key", "admin.key", "sa.key", "apiserver-kubelet-client.key",
            "kube-scheduler.key", "kube-controller-manager.key"} <= names
    assert {oct(path.stat().st_mode & 0o777) for path in secrets} == {"0o600"}


def test_a_server_that_dies_at_startup_is_reported_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    proc = processes.spawn(["sh", "-c", "echo 'TLS setup failed: no such key'; exit 3"], log,
                           die_with_parent=True)
    with pytest.raises(processes.StartupError) as err:
        processes.wait_until(lambda: False, what="fake-server", proc=proc, log_path=log,
                             timeout=30)
    assert "fake-server exited with code 3" in str(err.value)
    assert "TLS setup failed: no such key" in str(err.value)
    assert not isinstance(err.value, processes.PortTaken)


def test_a_port_taken_after_it_was_chosen_is_retried_with_fresh_ports(tmp_path):
    """Another program binds our pick before the server does: the server fails, we retry."""
    blockers: list[socket.socket] = []
    servers: list[subprocess.Popen] = []

    def launch(ports: list[int]) -> int:
        if not blockers:
            blockers.append(socket.create_server(("127.0.0.1", ports[0])))
        log = tmp_path / f"server-{len(servers)}.log"
        servers.append(processes.spawn(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
             str(tmp_path), str(ports[0])], log, die_with_parent=True))
        processes.wait_until(lambda: probes.responds(f"http://127.0.0.1:{ports[0]}/"),
                             what="http.server", proc=servers[-1], log_path=log, timeout=30)
        return ports[0]

    try:
        port = processes.with_free_ports(1, launch)
        assert port != blockers[0].getsockname()[1]
        assert "Address already in use" in (tmp_path / "server-0.log").read_text()
        assert probes.responds(f"http://127.0.0.1:{port}/")
    finally:
        for server in servers:
            processes.stop_group(server)
        for blocker in blockers:
            blocker.close()


KEEP_SERVERS = """
import json, sys, time
from pathlib import Path
from tessera_dev.controlplane import launcher, prometheus
root = Path(sys.argv[1])
plane = launcher.ControlPlane.start(root / "cp", launcher.prebuilt())
prom = prometheus.Prometheus.start({}, root / "prom")
print(json.dumps({**plane.pids, "prometheus": prom._proc.pid}), flush=True)
time.sleep(300)
"""


def test_servers_of_a_killed_test_run_die_with_it(tmp_path):
    """A SIGKILLed pytest runs no teardown; its control plane and Prometheus must not linger."""
    holder = subprocess.Popen([sys.executable, "-c", KEEP_SERVERS, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    pids: dict[str, int] = {}
    try:
        pids = json.loads(holder.stdout.readline())
        assert all(processes.runs(pid, name) for name, pid in pids.items())
        holder.kill()
        holder.wait()
        probes.poll_until(
            lambda: [name for name, pid in pids.items() if processes.runs(pid, name)],
            lambda left: not left, timeout=10,
            error=lambda left: AssertionError(f"still running after their parent died: {left}"))
    finally:
        holder.kill()
        for name, pid in pids.items():
            if processes.runs(pid, name):
                processes.stop_group(pid)


def test_nodes_that_fail_to_start_leave_a_running_control_plane_as_it_was(control_plane,
                                                                          admin_api, tmp_path):
    """`tessera-dev up` on a control plane already running (the user's objects in it) starts the
    nodes again; when that fails, the control plane and its data stay."""
    state = tmp_path / "state"  # no cluster recorded: every node is started again
    state.mkdir()
    args = argparse.Namespace(dcgm_generation="3.0", data_dir=state)
    with pytest.raises(ValueError, match="DCGM exporter generation"):
        up._reuse(Console(file=io.StringIO()), control_plane, args, cluster.node_specs(1, 1))
    assert state.is_dir()
    assert client.CoreV1Api(admin_api).list_namespace(_request_timeout=10).items
