"""Storage on the local cluster: a ReadWriteMany claim on the cluster's NFS share is one set of
files for pods on every node, a pod whose claim is not bound yet waits with the reason and runs
once it is, and a memory-backed emptyDir gives a pod a writable tmpfs at /dev/shm that goes with
the pod. Real control plane (its PersistentVolume binder and Node authorizer), real nodes."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from kubernetes import client
from nodeharness import container_status, logs, phase_in, python, wait_pod, wait_pod_gone

from tessera_dev import probes
from tessera_dev.simnode.faults import node_dir
from tessera_dev.simnode.volumes import SHM, memory_root, writable_tmpfs

pytestmark = pytest.mark.cluster

WRITE = """
import os, sys
with open(os.path.join(sys.argv[1], "step-10.ckpt"), "w") as f:
    f.write("written on " + os.environ["NODE_NAME"])
"""
READ = """
import errno, os, sys
print(open(os.path.join(sys.argv[1], "step-10.ckpt")).read())
try:
    open(os.path.join(sys.argv[1], "mine"), "w")
    print("writable")
except OSError as exc:
    print("read-only" if exc.errno == errno.EROFS else exc)
"""
SHM_CHECK = """
import json, os
with open("/dev/shm/marker", "w") as f:
    f.write("in memory")
# the mount that shows at /dev/shm is the last one listed for it
types = [line.split()[2] for line in open("/proc/self/mounts") if line.split()[1] == "/dev/shm"]
print(json.dumps({"fstype": types[-1], "marker": open("/dev/shm/marker").read()}))
"""


def claim_pod(name: str, code: str, claim: str, *, node: str, pin: str = "nodeSelector",
              read_only: bool = False) -> dict[str, Any]:
    """A pod running `code` with the claim mounted at a fresh path (its argv[1]), on `node` by
    the scheduler (nodeSelector) or bound to it directly (nodeName)."""
    mount = f"/tmp/tessera-test-{uuid.uuid4().hex}"
    placement = {"nodeSelector": {"kubernetes.io/hostname": node}} if pin == "nodeSelector" \
        else {"nodeName": node}
    return {"metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 5, **placement,
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim,
                                                               "readOnly": read_only}}],
        "containers": [{
            "name": "main", "image": "tessera-trainer:0.1.0",
            "command": [*python(code), mount],
            "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {
                "fieldPath": "spec.nodeName"}}}],
            "volumeMounts": [{"name": "data", "mountPath": mount}]}]}}


def finished(api: client.ApiClient, namespace: str, name: str) -> tuple[dict[str, Any], str]:
    """Wait for a pod to finish; returns it and its log."""
    pod = wait_pod(api, namespace, name, phase_in("Succeeded", "Failed"))
    return pod, logs(api, namespace, name)


def test_a_shared_claim_carries_files_from_one_node_to_another(local_cluster, admin_api,
                                                               namespace):
    core = client.CoreV1Api(admin_api)
    claim = local_cluster.shared_volume(admin_api, "checkpoints", namespace, size="1Gi")
    core.create_namespaced_pod(namespace, claim_pod("writer", WRITE, claim, node="gpu-node-0"))
    writer, text = finished(admin_api, namespace, "writer")
    assert writer["status"]["phase"] == "Succeeded", (writer["status"], text)
    assert writer["spec"]["nodeName"] == "gpu-node-0"
    # the other node reads it through the same claim, mounted read-only there
    core.create_namespaced_pod(namespace, claim_pod("reader", READ, claim, node="gpu-node-1",
                                                    read_only=True))
    reader, text = finished(admin_api, namespace, "reader")
    assert reader["status"]["phase"] == "Succeeded", (reader["status"], text)
    assert reader["spec"]["nodeName"] == "gpu-node-1"
    assert text.splitlines() == ["written on gpu-node-0", "read-only"]
    share = local_cluster.shared_path("checkpoints", namespace)
    assert sorted(p.name for p in share.iterdir()) == ["step-10.ckpt"]


def test_a_pod_waits_for_its_claim_to_be_bound_then_runs(local_cluster, admin_api, namespace):
    core = client.CoreV1Api(admin_api)
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "later"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "resources": {"requests": {"storage": "1Gi"}}}})
    # bound to the node directly: the scheduler, which holds back pods with unbound claims,
    # is not asked, so the node itself has to wait
    core.create_namespaced_pod(namespace, claim_pod("patient", WRITE, "later", node="gpu-node-1",
                                                    pin="nodeName"))
    waiting = wait_pod(admin_api, namespace, "patient", lambda p: [
        s["state"].get("waiting", {}).get("reason")
        for s in (p.get("status") or {}).get("containerStatuses") or []] == ["FailedMount"])
    assert waiting["status"]["phase"] == "Pending"
    message = container_status(waiting)["state"]["waiting"]["message"]
    assert f"persistentVolumeClaim {namespace}/later is not bound" in message, message
    local_cluster.shared_volume(admin_api, "later", namespace, size="1Gi")
    done, text = finished(admin_api, namespace, "patient")
    assert done["status"]["phase"] == "Succeeded", (done["status"], text)
    assert (local_cluster.shared_path("later", namespace) / "step-10.ckpt").read_text() == \
        "written on gpu-node-1"


def test_a_memory_empty_dir_is_a_writable_tmpfs_that_goes_with_the_pod(
        local_cluster, admin_api, namespace):
    if not writable_tmpfs(SHM):
        pytest.skip("this host has no writable tmpfs at /dev/shm: Memory emptyDirs are plain "
                    "directories here (the volume tests cover that)")
    core = client.CoreV1Api(admin_api)
    created = core.create_namespaced_pod(namespace, {"metadata": {"name": "shm"}, "spec": {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
        "nodeSelector": {"kubernetes.io/hostname": "gpu-node-0"},
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "containers": [{"name": "main", "image": "tessera-trainer:0.1.0",
                        "command": python(SHM_CHECK),
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]}})
    pod, text = finished(admin_api, namespace, "shm")
    assert pod["status"]["phase"] == "Succeeded", (pod["status"], text)
    assert json.loads(text.splitlines()[-1]) == {"fstype": "tmpfs", "marker": "in memory"}
    # on the host: the pod's folder on the node's tmpfs, not the host's /dev/shm itself
    folder = memory_root(node_dir(local_cluster.plane.data_dir, "gpu-node-0")) / \
        f"{namespace}_shm_{created.metadata.uid}"
    assert (folder / "dshm" / "marker").read_text() == "in memory"
    assert not (SHM / "marker").exists()
    core.delete_namespaced_pod("shm", namespace)
    wait_pod_gone(admin_api, namespace, "shm")
    probes.poll_until(folder.exists, lambda there: not there, timeout=30, interval=0.2,
                      error=lambda _: AssertionError(f"{folder} still there after the pod"))
