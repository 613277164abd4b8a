"""The local control plane: kubectl works as admin, tokens work, and RBAC is really enforced."""

from __future__ import annotations

import subprocess

import pytest
from kubernetes import client
from tessera_operator.controlplane import processes

pytestmark = pytest.mark.foundation


def test_kubectl_talks_to_the_server_as_admin(control_plane):
    whoami = subprocess.run(
        ["kubectl", "--kubeconfig", str(control_plane.kubeconfig), "auth", "whoami", "-o",
         "jsonpath={.status.userInfo.groups}"], capture_output=True, text=True, timeout=60)
    assert whoami.returncode == 0, whoami.stderr
    assert "system:masters" in whoami.stdout


def test_pods_can_be_created_in_a_fresh_namespace(admin_api, namespace):
    pod = {"metadata": {"name": "trainer-0"},
           "spec": {"containers": [{"name": "trainer", "image": "busybox"}]}}
    client.CoreV1Api(admin_api).create_namespaced_pod(namespace, pod)
    stored = client.CoreV1Api(admin_api).read_namespaced_pod("trainer-0", namespace)
    assert stored.status.phase == "Pending"  # no scheduler or kubelet plays the node here


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
        assert pods.list_namespaced_pod(namespace).items == []
        # 3. and only what the Role grants
        with pytest.raises(client.ApiException) as err:
            pods.create_namespaced_pod(namespace, {"metadata": {"name": "x"}, "spec": {
                "containers": [{"name": "x", "image": "busybox"}]}})
        assert err.value.status == 403


def test_a_server_that_dies_at_startup_is_reported_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    proc = processes.spawn(["sh", "-c", "echo 'bind: address already in use'; exit 3"], log)
    with pytest.raises(processes.StartupError) as err:
        processes.wait_until(lambda: False, what="fake-server", proc=proc, log_path=log,
                             timeout=30)
    assert "fake-server exited with code 3" in str(err.value)
    assert "bind: address already in use" in str(err.value)
