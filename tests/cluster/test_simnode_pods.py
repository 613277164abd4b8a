"""Pods on a simulated node: what the process sees, its service account, restarts, deletion,
malformed specs and `kubectl logs`, against the real API server."""

from __future__ import annotations

import os
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from kubernetes import client
from nodeharness import (
    SimNode,
    container_status,
    events,
    last_json_line,
    logs,
    phase_in,
    pod_manifest,
    python,
    start_node,
    stop_node,
    wait_pod,
    wait_pod_gone,
)

from tessera_dev.controlplane import launcher, pki
from tessera_dev.simnode.server import kubelet_endpoint

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def node(control_plane: launcher.ControlPlane, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[SimNode]:
    running = start_node(control_plane, tmp_path_factory.mktemp("simnode"))
    yield running
    stop_node(running)


def create(api: client.ApiClient, namespace: str, pod: dict) -> str:
    client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
    return pod["metadata"]["name"]


SEES = """
import json, os, socket, sys
ip = os.environ["POD_IP"]
with socket.socket() as s:
    s.bind((ip, 0))
    bound = s.getsockname()[0]
devices = os.environ.get("TESSERA_SIM_DEVICES", "/nonexistent")
held = []
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith(devices + "/"):
        held.append(os.path.basename(target))
print(json.dumps({"env": dict(os.environ), "argv": sys.argv[1:], "bound": bound,
                  "held": sorted(held), "hostname": socket.gethostname(),
                  "resolved": socket.gethostbyname(socket.gethostname())}))
"""


def test_process_sees_env_pod_ip_and_gpus(control_plane: launcher.ControlPlane,
                                          admin_api: client.ApiClient, namespace: str,
                                          node: SimNode) -> None:
    core = client.CoreV1Api(admin_api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "greeting"},
                                                  "data": {"text": "hello"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "extra"},
                                              "stringData": {"TOKEN": "s3cret"}})
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "greeting",
                                                               "key": "text"}}},
        {"name": "MSG", "value": "$(GREETING) from $(NODE)"},
    ]
    pod = pod_manifest("sees", node, python(SEES), container={
        "args": ["$(MSG)"], "env": env, "envFrom": [{"secretRef": {"name": "extra"}}],
        "resources": {"limits": {"nvidia.com/gpu": "2"}}})
    create(admin_api, namespace, pod)
    done = wait_pod(admin_api, namespace, "sees", phase_in("Succeeded", "Failed"))
    seen = last_json_line(logs(admin_api, namespace, "sees"))
    assert done["status"]["phase"] == "Succeeded", done["status"]
    state = container_status(done)["state"]["terminated"]
    assert (state["exitCode"], state["reason"]) == (0, "Completed")
    # the device plugin's part: two distinct GPUs of this node, held open by the process
    gpus = [int(i) for i in seen["env"]["NVIDIA_VISIBLE_DEVICES"].split(",")]
    assert len(set(gpus)) == 2 and all(0 <= i < node.gpus for i in gpus)
    assert seen["held"] == sorted(f"nvidia{i}" for i in gpus)
    assert seen["env"]["TESSERA_SIM_GPU_STATE"] == str(node.dir / "gpus.json")
    # a pod IP of its own in the node's /24, which the process can bind
    pod_ip = done["status"]["podIP"]
    assert seen["env"]["POD_IP"] == seen["bound"] == pod_ip
    assert seen["resolved"] == pod_ip  # its host name, through the kubelet's hosts file
    assert pod_ip.startswith(node.pod_ip_prefix()) and pod_ip != node.address
    assert done["status"]["hostIP"] == node.address
    # downward API, references, $(VAR) expansion, the API server's real address
    assert seen["argv"] == [f"hello from {node.name}"]
    assert seen["env"]["POD_NS"] == namespace and seen["env"]["TOKEN"] == "s3cret"
    # the pod's host name, as the process itself asks for it (a kubelet gives each pod one)
    assert seen["env"]["HOSTNAME"] == seen["hostname"] == "sees"
    server = urlsplit(control_plane.server)
    assert (seen["env"]["KUBERNETES_SERVICE_HOST"], seen["env"]["KUBERNETES_SERVICE_PORT"]) \
        == (server.hostname, str(server.port))
    conditions = {c["type"]: c["status"] for c in done["status"]["conditions"]}
    assert conditions["Initialized"] == "True" and conditions["Ready"] == "False"


WHO_AM_I = """
import json
from kubernetes import client, config
config.load_incluster_config()
api = client.ApiClient()
core = client.CoreV1Api(api)
ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
names = sorted(c.metadata.name for c in core.list_namespaced_config_map(ns).items)
try:
    core.list_namespaced_secret(ns)
    secrets = "allowed"
except client.ApiException as exc:
    secrets = exc.status
review = client.AuthenticationV1Api(api).create_self_subject_review(
    {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
user = review.status.user_info
print(json.dumps({"configmaps": names, "secrets": secrets, "user": user.username,
                  "extra": user.extra}))
"""


def test_service_account_token_gets_what_rbac_allows(admin_api: client.ApiClient,
                                                     namespace: str, node: SimNode) -> None:
    core, rbac = client.CoreV1Api(admin_api), client.RbacAuthorizationV1Api(admin_api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "read-configmaps"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "read-configmaps"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "visible"}})
    pod = pod_manifest("who", node, python(WHO_AM_I), serviceAccountName="reader")
    create(admin_api, namespace, pod)
    done = wait_pod(admin_api, namespace, "who", phase_in("Succeeded", "Failed"))
    out = logs(admin_api, namespace, "who")
    assert done["status"]["phase"] == "Succeeded", out
    seen = last_json_line(out)
    assert "visible" in seen["configmaps"]  # what its Role allows
    assert seen["secrets"] == 403  # and nothing else
    assert seen["user"] == f"system:serviceaccount:{namespace}:reader"
    # a TokenRequest token bound to this pod, as the kubelet asks for it
    assert seen["extra"]["authentication.kubernetes.io/pod-name"] == ["who"]
    assert seen["extra"]["authentication.kubernetes.io/node-name"] == [node.name]


def test_restart_policies_and_exit_codes(admin_api: client.ApiClient, namespace: str,
                                         node: SimNode) -> None:
    state = f"/tmp/tessera-test-{uuid.uuid4().hex}"
    once = (f"import os, sys\nmarker = '{state}/crashed'\n"
            "if os.path.exists(marker):\n    sys.exit(0)\nopen(marker, 'w').close()\nsys.exit(1)")
    scratch = {"volumes": [{"name": "scratch", "emptyDir": {}}]}
    mount = {"volumeMounts": [{"name": "scratch", "mountPath": state}]}
    init = [{"name": f"init{i}", "image": "busybox", "volumeMounts": mount["volumeMounts"],
             "command": ["sh", "-c", f"echo -n {i} >> {state}/order"]} for i in (1, 2)]
    pods = [
        pod_manifest("never", node, ["sh", "-c", "exit 3"]),
        pod_manifest("onfailure", node, python(once), restartPolicy="OnFailure",
                     container=mount, **scratch),
        pod_manifest("always", node, ["sh", "-c", "echo crash; exit 1"],
                     restartPolicy="Always"),
        pod_manifest("inits", node, ["cat", f"{state}/order"], initContainers=init,
                     container=mount, **scratch),
    ]
    for pod in pods:
        create(admin_api, namespace, pod)

    never = wait_pod(admin_api, namespace, "never", phase_in("Succeeded", "Failed"))
    status = container_status(never)
    assert never["status"]["phase"] == "Failed"
    assert status["state"]["terminated"]["exitCode"] == 3
    assert status["state"]["terminated"]["reason"] == "Error"
    assert status["restartCount"] == 0

    onfailure = wait_pod(admin_api, namespace, "onfailure", phase_in("Succeeded", "Failed"))
    status = container_status(onfailure)
    assert onfailure["status"]["phase"] == "Succeeded"
    assert status["restartCount"] == 1  # the emptyDir outlived the first run
    assert status["lastState"]["terminated"]["exitCode"] == 1
    assert status["state"]["terminated"]["reason"] == "Completed"

    # the first restart is immediate, the second waits out the back-off
    always = wait_pod(admin_api, namespace, "always", lambda p: any(
        s["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff"
        for s in (p.get("status") or {}).get("containerStatuses") or []))
    status = container_status(always)
    assert always["status"]["phase"] == "Running"
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 1
    assert logs(admin_api, namespace, "always", previous=True) == "crash\n"
    assert {("Normal", "Started"), ("Warning", "BackOff")} <= events(admin_api, namespace,
                                                                     "always")

    inits = wait_pod(admin_api, namespace, "inits", phase_in("Succeeded", "Failed"))
    assert inits["status"]["phase"] == "Succeeded"
    assert [s["state"]["terminated"]["exitCode"] for s in inits["status"][
        "initContainerStatuses"]] == [0, 0]
    assert logs(admin_api, namespace, "inits") == "12"  # in order, before the app container


GRACEFUL = """
import os, signal, sys, time
d = sys.argv[1]
def term(signum, frame):
    with open(d + "/events", "a") as f:
        f.write("TERM\\n")
    if sys.argv[2] == "exit":
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
with open(d + "/pid", "w") as f:
    f.write(os.readlink("/proc/self"))  # the host's pid: /proc is the host's
open(d + "/ready", "w").close()
while True:
    time.sleep(3600)
"""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_graceful_deletion_sigterm_then_sigkill(admin_api: client.ApiClient, namespace: str,
                                                node: SimNode) -> None:
    grace = {"stubborn": 3, "polite": 30}
    for name, mode in (("stubborn", "ignore"), ("polite", "exit")):
        mount = f"/tmp/tessera-test-{uuid.uuid4().hex}"
        pod = pod_manifest(name, node, python(GRACEFUL), terminationGracePeriodSeconds=grace[
            name], volumes=[{"name": "out", "hostPath": {"path": f"/graceful/{namespace}/{name}",
                                                          "type": "DirectoryOrCreate"}}],
                           container={
            "args": [mount, mode], "volumeMounts": [{"name": "out", "mountPath": mount}],
            "readinessProbe": {"exec": {"command": ["cat", f"{mount}/ready"]},
                               "periodSeconds": 1}})
        create(admin_api, namespace, pod)
    core = client.CoreV1Api(admin_api)
    for name in grace:
        wait_pod(admin_api, namespace, name, lambda p: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or []))
    host = {name: node.dir / "root" / "graceful" / namespace / name for name in grace}
    pids = {name: int((host[name] / "pid").read_text()) for name in grace}
    took = {}
    for name in grace:
        start = time.monotonic()
        core.delete_namespaced_pod(name, namespace)
        wait_pod_gone(admin_api, namespace, name)
        took[name] = time.monotonic() - start
    for name in grace:
        assert (host[name] / "events").read_text() == "TERM\n"
        assert not _pid_alive(pids[name])
    # ignoring SIGTERM buys exactly the grace period, then SIGKILL
    assert took["stubborn"] >= grace["stubborn"]
    # a process that exits on SIGTERM ends its pod without waiting out the grace period
    assert took["polite"] < grace["polite"]


def test_malformed_specs_fail_with_a_reason_and_the_node_serves_on(
        admin_api: client.ApiClient, namespace: str, node: SimNode) -> None:
    bad = {
        "nfs": pod_manifest("nfs", node, ["true"], volumes=[
            {"name": "share", "nfs": {"server": "10.0.0.1", "path": "/export"}}]),
        "no-such-binary": pod_manifest("no-such-binary", node, ["/no/such/binary", "--flag"]),
    }
    # pod reason, what its message names, the reason of the Warning event (`kubectl describe`)
    expected = {"nfs": ("UnsupportedVolume", "nfs", "UnsupportedVolume"),
                "no-such-binary": ("ContainerCannotRun", "/no/such/binary", "Failed")}
    for pod in bad.values():
        create(admin_api, namespace, pod)
    for name, (reason, named, event) in expected.items():
        failed = wait_pod(admin_api, namespace, name, phase_in("Failed", "Succeeded"))
        assert failed["status"]["phase"] == "Failed"
        assert failed["status"]["reason"] == reason
        assert named in failed["status"]["message"]
        assert ("Warning", event) in events(admin_api, namespace, name)
    assert node.proc.poll() is None
    create(admin_api, namespace, pod_manifest("fine", node, ["echo", "fine"]))
    fine = wait_pod(admin_api, namespace, "fine", phase_in("Succeeded", "Failed"))
    assert fine["status"]["phase"] == "Succeeded"


@pytest.mark.hardening
def test_an_image_the_node_cannot_run_waits_as_an_image_that_cannot_be_pulled(
        admin_api: client.ApiClient, namespace: str, node: SimNode) -> None:
    """No command and an image that is not one of this project's: the node cannot know what to
    run, as a kubelet cannot pull an image. The pod stays Pending with the kubelet's waiting
    reasons (ErrImagePull, then ImagePullBackOff) and its Warning event, in an init container
    as in an app container, until it is deleted; the node serves on."""
    create(admin_api, namespace, pod_manifest("no-command", node, []))
    create(admin_api, namespace, pod_manifest(
        "init-no-command", node, ["true"], initContainers=[
        {"name": "fetch", "image": "busybox"}]))
    for name, statuses in (("no-command", "containerStatuses"),
                           ("init-no-command", "initContainerStatuses")):
        pod = wait_pod(admin_api, namespace, name, lambda p, k=statuses: any(
            ((s.get("state") or {}).get("waiting") or {}).get("reason") == "ImagePullBackOff"
            for s in (p.get("status") or {}).get(k) or []))
        assert pod["status"]["phase"] == "Pending"
        [status] = pod["status"][statuses]
        assert "busybox" in status["state"]["waiting"]["message"]
        assert ("Warning", "Failed") in events(admin_api, namespace, name)
    for name in ("no-command", "init-no-command"):
        client.CoreV1Api(admin_api).delete_namespaced_pod(name, namespace)
        wait_pod_gone(admin_api, namespace, name)
    assert node.proc.poll() is None


def test_kubectl_logs_through_the_api_server(admin_api: client.ApiClient, namespace: str,
                                             node: SimNode) -> None:
    create(admin_api, namespace, pod_manifest("lines", node, [
        "sh", "-c", "for i in 1 2 3 4 5; do echo line $i; done; echo oops >&2"]))
    wait_pod(admin_api, namespace, "lines", phase_in("Succeeded", "Failed"))
    assert logs(admin_api, namespace, "lines") == \
        "line 1\nline 2\nline 3\nline 4\nline 5\noops\n"
    assert logs(admin_api, namespace, "lines", tail_lines=2) == "line 5\noops\n"
    with pytest.raises(client.ApiException) as missing:
        logs(admin_api, namespace, "lines", container="nope")
    assert missing.value.status in (400, 404)


def test_hostpath_lands_under_the_node_root(admin_api: client.ApiClient, namespace: str,
                                            node: SimNode) -> None:
    mount = f"/tmp/tessera-test-{uuid.uuid4().hex}"
    create(admin_api, namespace, pod_manifest(
        "writer", node, ["sh", "-c", f"echo written > {mount}/file"],
        volumes=[{"name": "h", "hostPath": {"path": f"/var/lib/{namespace}",
                                            "type": "DirectoryOrCreate"}}],
        container={"volumeMounts": [{"name": "h", "mountPath": mount}]}))
    wait_pod(admin_api, namespace, "writer", phase_in("Succeeded", "Failed"))
    assert (node.dir / "root" / "var" / "lib" / namespace / "file").read_text() == "written\n"
    # the bind mount was private to the container: the host's mount point stays empty
    assert not any(Path(mount).iterdir())


def test_probes_gate_readiness_and_restart_the_unhealthy(admin_api: client.ApiClient,
                                                         namespace: str, node: SimNode) -> None:
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    create(admin_api, namespace, pod_manifest(
        "served", node, ["python", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
        container={"env": [pod_ip], "ports": [{"name": "http", "containerPort": 8080}],
                   "readinessProbe": {"httpGet": {"path": "/", "port": "http"},
                                      "periodSeconds": 1}}))
    create(admin_api, namespace, pod_manifest(
        "unhealthy", node, ["sleep", "3600"], restartPolicy="Always",
        terminationGracePeriodSeconds=2, container={
            "livenessProbe": {"exec": {"command": ["false"]}, "periodSeconds": 1,
                              "failureThreshold": 2}}))
    served = wait_pod(admin_api, namespace, "served", lambda p: any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (p.get("status") or {}).get("conditions") or []))
    assert container_status(served)["ready"]
    url = f"http://{served['status']['podIP']}:8080/"
    with urllib.request.urlopen(url, timeout=5) as answer:
        assert answer.status == 200
    unhealthy = wait_pod(admin_api, namespace, "unhealthy",
                         lambda p: container_status(p)["restartCount"] >= 1
                         if (p.get("status") or {}).get("containerStatuses") else False)
    last = container_status(unhealthy)["lastState"]["terminated"]
    assert last["exitCode"] == 128 + signal.SIGTERM  # the probe's kill, passed on by the shim
    assert "liveness" in last["message"]
    assert {("Warning", "Unhealthy"), ("Normal", "Killing")} <= events(admin_api, namespace,
                                                                       "unhealthy")


def test_kubelet_endpoint_serves_only_whom_the_api_server_authorizes(
        control_plane: launcher.ControlPlane, node: SimNode, tmp_path: Path) -> None:
    keys = control_plane.keys
    other = pki.client_certificate(keys, tmp_path, "other-node", "system:node:other-node",
                                   ("system:nodes",))
    no_cert = ssl.create_default_context(cafile=str(keys.ca_cert))
    url = f"https://{node.address}:10250/containerLogs/default/absent/main"

    def get(cert: tuple[Path, Path] | None) -> int:
        context = ssl.create_default_context(cafile=str(keys.ca_cert))
        if cert is not None:
            context.load_cert_chain(*map(str, cert))
        try:
            with urllib.request.urlopen(url, context=context, timeout=10) as answer:
                return answer.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert get((keys.admin_cert, keys.admin_key)) == 404  # allowed in: no such pod here
    assert get(other) == 403  # a node may not read another node's kubelet API
    # no certificate: the server ends the TLS session, with the "certificate required" alert,
    # or, when the client has not read that alert before the close, as an EOF (TLS 1.3 sends it
    # after the handshake)
    with pytest.raises(OSError, match="CERTIFICATE_REQUIRED|EOF occurred in violation"):
        urllib.request.urlopen(url, context=no_cert, timeout=10).close()
    assert get((keys.admin_cert, keys.admin_key)) == 404  # and it still serves who may


def test_a_followed_log_loses_no_line_written_while_the_follower_joins(
        control_plane: launcher.ControlPlane, tmp_path: Path) -> None:
    """`kubectl logs -f` shows every line from the start, whenever the follower joins: lines
    land while followers connect, and each must read them all, once each, in order."""
    keys = control_plane.keys
    address = "127.0.0.251"
    cert, key = pki.serving_certificate(keys, tmp_path, "follow", (address,))
    log_file = tmp_path / "0.log"
    log_file.write_bytes(b"")
    writing = threading.Event()
    writing.set()
    endpoint = kubelet_endpoint(
        address, 0, cert=cert, key=key, client_ca=keys.ca_cert,
        find_logs=lambda *_: (log_file, writing.is_set), authorize=lambda *_: True)
    port = endpoint.server_address[1]
    context = ssl.create_default_context(cafile=str(keys.ca_cert))
    context.load_cert_chain(str(keys.admin_cert), str(keys.admin_key))
    url = f"https://{address}:{port}/containerLogs/ns/pod/main?follow=true"
    lines = [f"line {i}\n".encode() for i in range(200)]
    bodies: list[bytes] = []

    def follow() -> None:
        with urllib.request.urlopen(url, context=context, timeout=30) as answer:
            bodies.append(answer.read())

    followers = [threading.Thread(target=follow) for _ in range(40)]
    try:
        with log_file.open("ab", buffering=0) as out:
            for i, line in enumerate(lines):
                if i % 5 == 0:
                    followers[i // 5].start()
                out.write(line)
                time.sleep(0.001)
        writing.clear()
        for follower in followers:
            follower.join(timeout=30)
    finally:
        endpoint.shutdown()
        endpoint.server_close()
    assert len(bodies) == len(followers)
    assert all(body == b"".join(lines) for body in bodies)
