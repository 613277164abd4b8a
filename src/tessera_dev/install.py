"""Tessera installed on a cluster as a user installs it (`kubectl apply --server-side -k`), and
the wait until it runs: the operator Deployment with every replica available and each DaemonSet
of its namespace (the power agents) with a ready pod on every node. Readiness, not pod phase: a
standby operator replica is Ready, and a pod Running but not Ready serves nothing yet."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kubernetes import client

from tessera_dev import paths, probes
from tessera_operator.leader import LEASE_NAME

LOCAL_OVERLAY = paths.repo_root() / "manifests" / "local"
SYSTEM_NS, OPERATOR = "tessera-system", "tessera-operator"
INSTALL_TIMEOUT_S = 300.0


def apply(kubeconfig: Path, overlay: Path = LOCAL_OVERLAY) -> None:
    """`kubectl apply --server-side --force-conflicts -k overlay`; its error output on failure."""
    done = subprocess.run(
        ["kubectl", "apply", "--server-side", "--force-conflicts", "-k", str(overlay)],
        env=os.environ | {"KUBECONFIG": str(kubeconfig)}, capture_output=True, text=True,
        timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl apply -k {overlay} failed: {done.stderr.strip()}")


def missing(api: client.ApiClient, nodes: int, namespace: str = SYSTEM_NS) -> str | None:
    """What of the install is not ready yet, in words; None once all of it is."""
    apps = client.AppsV1Api(api)
    try:
        deployment = apps.read_namespaced_deployment(OPERATOR, namespace, _request_timeout=10)
        daemon_sets = apps.list_namespaced_daemon_set(namespace, _request_timeout=10).items
    except client.ApiException as exc:
        return f"{namespace}: {exc.reason}"
    want, status = deployment.spec.replicas, deployment.status
    if (status.observed_generation or 0) < deployment.metadata.generation or not (
            status.updated_replicas == status.available_replicas == status.replicas == want):
        return (f"{OPERATOR}: {status.available_replicas or 0} of {want} replicas available "
                f"({status.updated_replicas or 0} updated)")
    if not daemon_sets:
        return f"no DaemonSet in {namespace}"
    for ds in daemon_sets:
        st = ds.status
        if not (st.desired_number_scheduled == st.number_ready == st.updated_number_scheduled
                == nodes):
            return (f"{ds.metadata.name}: {st.number_ready or 0} of {nodes} nodes with a ready "
                    f"pod ({st.updated_number_scheduled or 0} updated)")
    return None


def wait(api: client.ApiClient, nodes: int, timeout: float = INSTALL_TIMEOUT_S,
         namespace: str = SYSTEM_NS) -> None:
    """Until `missing` says nothing is; TimeoutError naming what still was."""
    probes.wait_for("Tessera ready", lambda: missing(api, nodes, namespace),
                    lambda left: left is None, timeout=timeout)


def _leader(api: client.ApiClient, namespace: str) -> tuple[str, str | None] | None:
    """(pod, node) of the operator replica holding the Lease; None while nobody does (no Lease:
    a leader that stops deletes it; or its holder's pod is gone)."""
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(LEASE_NAME, namespace)
        if not (holder := lease.spec.holder_identity):
            return None
        pod = client.CoreV1Api(api).read_namespaced_pod(holder, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return holder, pod.spec.node_name


def leader_node(api: client.ApiClient, namespace: str = SYSTEM_NS) -> str | None:
    """The node of the operator replica holding the Lease; None while nobody does."""
    return None if (leader := _leader(api, namespace)) is None else leader[1]


def leader_off(api: client.ApiClient, node: str, timeout: float = INSTALL_TIMEOUT_S,
               namespace: str = SYSTEM_NS) -> None:
    """The operator's leader on another node than `node`: a leader there is deleted (it lets
    the Lease go on SIGTERM) until a replica on another node takes over (the Deployment's
    replacement may land on `node` and win the Lease first). A test that stops `node` whole
    keeps the operator out of it, as a real cluster keeps it off GPU nodes."""
    def moved() -> str | None:
        leader = _leader(api, namespace)
        if leader is not None and leader[1] == node:
            try:
                client.CoreV1Api(api).delete_namespaced_pod(leader[0], namespace)
            except client.ApiException as exc:
                if exc.status != 404:  # 404: already gone
                    raise
        return None if leader is None else leader[1]

    probes.wait_for(f"the operator's leader off {node}", moved,
                    lambda leader: leader not in (None, node), timeout=timeout, interval=0.5)
