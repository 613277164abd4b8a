"""A simulated node process for tests, and waits on pods and nodes driven by API watch events."""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from tessera_dev import processes
from tessera_dev.controlplane import kubeconfig, launcher, pki

WAIT_S = 60.0  # a safety bound for waits on the cluster, never the behaviour under test


@dataclass
class SimNode:
    """A running `tessera-dev sim-node` and where its state lives."""

    name: str
    address: str
    dir: Path
    gpus: int
    proc: subprocess.Popen
    log: Path

    def pod_ip_prefix(self) -> str:
        return self.address.rsplit(".", 1)[0] + "."


def node_argv(plane: launcher.ControlPlane, root: Path, name: str, address: str,
              gpus: int) -> list[str]:
    """The command line `tessera-dev up` gives a node, with a certificate for system:node:NAME."""
    keys = plane.keys
    certs = root / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    cert, key = pki.client_certificate(keys, certs, "node", f"system:node:{name}",
                                       ("system:nodes",))
    config = kubeconfig.write(certs / "kubeconfig", kubeconfig.render(
        plane.server, keys.ca_cert, kubeconfig.certificate_user(cert, key),
        f"system:node:{name}"))
    serving, serving_key = pki.serving_certificate(keys, certs, "kubelet", (address,))
    return [sys.executable, "-m", "tessera_dev.cli", "sim-node", "--name", name,
            "--dir", str(root / "node"), "--kubeconfig", str(config), "--address", address,
            "--gpus", str(gpus), "--domain-label", "nvidia.com/gpu.clique", "--domain",
            f"test.{name}", "--kubelet-cert", str(serving), "--kubelet-key", str(serving_key),
            "--client-ca", str(keys.ca_cert)]


def start_node(plane: launcher.ControlPlane, root: Path, gpus: int = 8) -> SimNode:
    """Start a node on an address of its own (127.1.200-249.1: clear of `tessera-dev up`'s nodes)
    and wait until the API server says it is Ready."""
    name = f"simnode-{secrets.token_hex(4)}"
    address = f"127.1.{200 + secrets.randbelow(50)}.1"
    root.mkdir(parents=True, exist_ok=True)
    log = root / "node.log"
    proc = processes.spawn(node_argv(plane, root, name, address, gpus), log,
                           die_with_parent=True)
    node = SimNode(name, address, root / "node", gpus, proc, log)
    with plane.api_client() as api:
        try:
            wait_node(api, name, node_ready)
        except BaseException:
            processes.stop_group(proc)
            pytest.fail(f"node {name} did not become Ready; its log:\n"
                        f"{processes.log_tail(log)}", pytrace=False)
    return node


def stop_node(node: SimNode) -> None:
    processes.stop_group(node.proc)


def node_ready(node: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in (node.get("status") or {}).get("conditions") or [])


def _wait(list_fn: Callable[..., Any], args: tuple, name: str,
          done: Callable[[dict[str, Any]], bool], what: str, timeout: float) -> dict[str, Any]:
    """Watch one object (by name) until `done` holds for it; returns it."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        stream = watch.Watch().stream(list_fn, *args, field_selector=f"metadata.name={name}",
                                      timeout_seconds=max(1, int(deadline - time.monotonic())))
        for event in stream:
            last = event["raw_object"]
            if event["type"] != "DELETED" and done(last):
                return last
    raise AssertionError(f"{what} {name}: condition not met within {timeout:.0f} s; last seen:\n"
                         f"{json.dumps((last or {}).get('status'), indent=1)[:6000]}")


def wait_node(api: client.ApiClient, name: str, done: Callable[[dict[str, Any]], bool],
              timeout: float = WAIT_S) -> dict[str, Any]:
    return _wait(client.CoreV1Api(api).list_node, (), name, done, "node", timeout)


def wait_pod(api: client.ApiClient, namespace: str, name: str,
             done: Callable[[dict[str, Any]], bool], timeout: float = WAIT_S) -> dict[str, Any]:
    return _wait(client.CoreV1Api(api).list_namespaced_pod, (namespace,), name, done, "pod",
                 timeout)


def wait_pod_gone(api: client.ApiClient, namespace: str, name: str,
                  timeout: float = WAIT_S) -> None:
    """Return once the pod object no longer exists."""
    core = client.CoreV1Api(api)
    listing = core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}")
    if not listing.items:
        return
    stream = watch.Watch().stream(
        core.list_namespaced_pod, namespace, field_selector=f"metadata.name={name}",
        resource_version=listing.metadata.resource_version, timeout_seconds=int(timeout))
    for event in stream:
        if event["type"] == "DELETED":
            return
    raise AssertionError(f"pod {namespace}/{name} still exists after {timeout:.0f} s")


def phase_in(*phases: str) -> Callable[[dict[str, Any]], bool]:
    return lambda pod: (pod.get("status") or {}).get("phase") in phases


def container_status(pod: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    statuses = pod["status"]["containerStatuses"]
    return next(s for s in statuses if name is None or s["name"] == name)


def pod_manifest(name: str, node: SimNode, command: list[str], **spec: Any) -> dict[str, Any]:
    """A pod bound to `node` directly (spec.nodeName), as the scheduler's binding would."""
    container: dict[str, Any] = {"name": "main", "image": "busybox", "command": command}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node.name, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 5, "containers": [container], **spec}}


def python(code: str) -> list[str]:
    """A container command running `code` with this environment's interpreter (as `python`)."""
    return ["python", "-c", code]


def logs(api: client.ApiClient, namespace: str, pod: str, **kw: Any) -> str:
    """`kubectl logs`: through the API server, which asks the node's kubelet endpoint."""
    return client.CoreV1Api(api).read_namespaced_pod_log(pod, namespace, **kw)


def events(api: client.ApiClient, namespace: str, pod: str) -> set[tuple[str, str]]:
    """(type, reason) of the Events about a pod, as `kubectl describe` lists them."""
    found = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pod}").items
    return {(e.type, e.reason) for e in found}


def last_json_line(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


def exited_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` (not necessarily our child) exits within `seconds` (a pidfd
    becomes readable when it does)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], max(0.0, seconds))[0])
    finally:
        os.close(fd)
