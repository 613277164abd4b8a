"""The local GPU cluster around a control plane: simulated GPU nodes, service discovery and
Prometheus, started, recorded and stopped together.

Node K is `gpu-node-K` at InternalIP 127.B.K.1 (all of 127/8 is loopback, so every node and pod
has an address of its own with the same ports); its pods take the rest of 127.B.K.0/24. B is the
first block whose node ports are free, so that several local clusters (a test's beside the
user's) never share an address. Each node
runs as its own process under its own identity (system:node:NAME), so the Node authorizer and
NodeRestriction treat it as they treat a kubelet. The GPU nodes' dcgm-exporter runs as the NVIDIA
GPU Operator runs it (manifests/local-gpu-operator/dcgm-exporter.yaml: DaemonSet
gpu-operator/nvidia-dcgm-exporter, a pod with its own address per node, behind the Service of
that name); the cluster is up once every node's exporter pod is ready. Each node also publishes
its GPUs as a ResourceSlice, as NVIDIA's DRA driver does, of the DeviceClass `gpu.nvidia.com`
the cluster makes (manifests/local-gpu-operator/deviceclass.yaml). Prometheus finds those
pods and the pods that ask to be scraped through the discovery endpoint, from what the API server
says, and evaluates Tessera's alert rules (manifests/monitoring/alerts.yaml, read at each start).

Shared storage: every node serves `nfs` PersistentVolumes from one folder, DATA_DIR/nfs (server
S, path P: DATA_DIR/nfs/S/P), so all nodes see the same files, as pods on a GPU cluster share a
ReadWriteMany claim for checkpoints and datasets. `Cluster.shared_volume(api, NAME, NAMESPACE)`
makes one in a call: a ReadWriteMany PersistentVolume on `nfs.tessera.local:/NAMESPACE/NAME`
(storageClassName "", so it binds statically) and the claim NAME bound to it by the
controller-manager; pods mount it as `persistentVolumeClaim: {claimName: NAME}`, and
`Cluster.shared_path(NAME, NAMESPACE)` is the folder on this machine that holds its files.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_dev import paths, probes, processes
from tessera_dev.controlplane import kueue, launcher, manifests, pki
from tessera_dev.controlplane.prometheus import (
    DCGM_EXPORTER,
    DCGM_NAMESPACE,
    Prometheus,
    kubernetes_scrape_configs,
    rule_groups,
)
from tessera_dev.simnode.dcgm import GENERATIONS
from tessera_dev.simnode.faults import node_dir
from tessera_dev.simnode.node import KUBELET_PORT
from tessera_dev.simnode.volumes import memory_root

CLUSTER_FILE = "cluster.json"
NODE_PREFIX = "gpu-node-"
DOMAIN_LABEL = "nvidia.com/gpu.clique"
DEFAULT_NODES = 2
DEFAULT_GPUS = 8
MAX_NODES = 254  # one /24 of 127.B.0.0/16 per node
# What every node binds on its address: the kubelet endpoint.
NODE_PORTS = (KUBELET_PORT,)
DCGM_GENERATIONS = GENERATIONS
DISCOVERY_RBAC = paths.repo_root() / "manifests" / "local" / "discovery-rbac.yaml"
DISCOVERY_USER = "tessera-discovery"
GPU_OPERATOR = paths.repo_root() / "manifests" / "local-gpu-operator" / "dcgm-exporter.yaml"
DEVICE_CLASS = paths.repo_root() / "manifests" / "local-gpu-operator" / "deviceclass.yaml"
# Guards against a hang, not bounds on startup: on two cores beside other clusters a node takes
# minutes to come up.
EXPORTER_READY_TIMEOUT_S = 300.0
ALERT_RULES = paths.repo_root() / "manifests" / "monitoring" / "alerts.yaml"
NODE_READY_TIMEOUT_S = 300.0
NFS_DIR = "nfs"  # under the data dir: the exports of the NFS server every node mounts
NFS_SERVER = "nfs.tessera.local"
BIND_TIMEOUT_S = 300.0
# The interpreter of this command: nodes run pods with this environment's tools.
PYTHON = sys.executable


@dataclass(frozen=True)
class NodeSpec:
    name: str
    address: str
    gpus: int
    domain: str


def _bindable(address: str) -> bool:
    for port in NODE_PORTS:
        with socket.socket() as sock:
            try:
                sock.bind((address, port))
            except OSError:
                return False
    return True


def free_block() -> int:
    """The first 127.B.0.0/16 block whose first node address has its ports free."""
    block = next((b for b in range(1, 255) if _bindable(f"127.{b}.0.1")), None)
    if block is None:
        raise processes.StartupError("every loopback block 127.B.0.1 has its node ports taken")
    return block


def node_specs(count: int, gpus: int, nodes_per_domain: int = 1,
               block: int | None = None) -> list[NodeSpec]:
    """The nodes of a local cluster: names, addresses and NVLink domains (an HGX node is a domain
    of its own; `nodes_per_domain` > 1 models racks such as NVL72 that span nodes). Without a
    block, the first free one."""
    if not 1 <= count <= MAX_NODES:
        raise ValueError(f"--nodes must be within 1..{MAX_NODES}, got {count}")
    if not 1 <= gpus <= 64:
        raise ValueError(f"--gpus-per-node must be within 1..64, got {gpus}")
    if nodes_per_domain < 1:
        raise ValueError(f"--nodes-per-domain must be at least 1, got {nodes_per_domain}")
    block = free_block() if block is None else block
    return [NodeSpec(f"{NODE_PREFIX}{k}", f"127.{block}.{k}.1", gpus,
                     f"local.{k // nodes_per_domain}") for k in range(count)]


def _node_argv(plane: launcher.ControlPlane, spec: NodeSpec, dcgm_generation: str) -> list[str]:
    home = node_dir(plane.data_dir, spec.name)
    home.mkdir(parents=True, exist_ok=True)
    keys = plane.keys
    kubeconfig = plane.identity_kubeconfig(
        f"node-{spec.name}", f"system:node:{spec.name}", ("system:nodes",))
    cert, key = pki.serving_certificate(keys, keys.ca_cert.parent, f"kubelet-{spec.name}",
                                        (spec.address,))
    return [PYTHON, "-m", "tessera_dev.cli", "sim-node", "--name", spec.name,
            "--dir", str(home), "--kubeconfig", str(kubeconfig), "--address", spec.address,
            "--gpus", str(spec.gpus), "--domain-label", DOMAIN_LABEL, "--domain", spec.domain,
            "--dcgm-generation", dcgm_generation, "--kubelet-cert", str(cert),
            "--kubelet-key", str(key), "--client-ca", str(keys.ca_cert),
            "--nfs-dir", str(plane.data_dir / NFS_DIR)]


def _ready_nodes(api: client.ApiClient) -> set[str]:
    nodes = client.CoreV1Api(api).list_node(_request_timeout=10).items
    return {n.metadata.name for n in nodes
            if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])}


def _exporters_ready(api: client.ApiClient) -> set[str]:
    """The nodes whose dcgm-exporter pod is ready."""
    pods = client.CoreV1Api(api).list_namespaced_pod(
        DCGM_NAMESPACE, label_selector=f"app={DCGM_EXPORTER}", _request_timeout=10).items
    return {p.spec.node_name for p in pods
            if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])}


def _has_default_account(api: client.ApiClient) -> bool:
    accounts = client.CoreV1Api(api).list_namespaced_service_account(
        "default", field_selector="metadata.name=default", _request_timeout=10).items
    return bool(accounts)


@dataclass
class Cluster:
    """A control plane with simulated GPU nodes, a discovery endpoint and Prometheus."""

    plane: launcher.ControlPlane
    nodes: dict[str, int] = field(default_factory=dict)  # node name -> pid
    discovery_pid: int | None = None
    prometheus_url: str | None = None
    prometheus_pid: int | None = None
    kueue_pid: int | None = None
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _prometheus: Prometheus | None = field(default=None, repr=False)
    _kueue: kueue.Kueue | None = field(default=None, repr=False)

    @classmethod
    def start(cls, plane: launcher.ControlPlane, specs: list[NodeSpec], *,
              dcgm_generation: str = "4.9", detached: bool = False) -> Cluster:
        """Start the nodes, wait until the API says they are Ready, then discovery and
        Prometheus. Detached processes outlive this one (`tessera-dev up`); otherwise they die
        with it."""
        if dcgm_generation not in DCGM_GENERATIONS:
            raise ValueError(f"DCGM exporter generation must be one of {DCGM_GENERATIONS}")
        cluster = cls(plane)
        try:
            # 1. one process per node, each under its own node identity
            for spec in specs:
                proc = processes.spawn(_node_argv(plane, spec, dcgm_generation),
                                       node_dir(plane.data_dir, spec.name) / "node.log",
                                       die_with_parent=not detached)
                cluster._procs.append(proc)
                cluster.nodes[spec.name] = proc.pid
            with plane.api_client() as api:
                wanted = {s.name for s in specs}
                probes.poll_until(lambda: _ready_nodes(api), lambda ready: wanted <= ready,
                                  timeout=NODE_READY_TIMEOUT_S, interval=0.5,
                                  error=lambda ready: processes.StartupError(
                                      f"nodes {sorted(wanted - ready)} not Ready after "
                                      f"{NODE_READY_TIMEOUT_S:.0f} s; see "
                                      f"{plane.data_dir / 'nodes'}/*/node.log"))
                # A pod is refused until its namespace's default service account exists (the
                # controller-manager makes it): the cluster is not up before one can run.
                probes.poll_until(lambda: _has_default_account(api), timeout=NODE_READY_TIMEOUT_S,
                                  interval=0.5, error=lambda _: processes.StartupError(
                                      "no default service account in namespace default after "
                                      f"{NODE_READY_TIMEOUT_S:.0f} s; see "
                                      f"{plane.data_dir}/kube-controller-manager.log"))
                # 2. every node's dcgm-exporter, as the GPU Operator runs it, and the DeviceClass
                #    of the GPUs the nodes publish as NVIDIA's DRA driver does
                manifests.apply(api, [GPU_OPERATOR, DEVICE_CLASS])
                probes.poll_until(lambda: _exporters_ready(api), lambda ready: wanted <= ready,
                                  timeout=EXPORTER_READY_TIMEOUT_S, interval=0.5,
                                  error=lambda ready: processes.StartupError(
                                      f"no ready dcgm-exporter pod on nodes "
                                      f"{sorted(wanted - ready)} after "
                                      f"{EXPORTER_READY_TIMEOUT_S:.0f} s; see `kubectl -n "
                                      f"{DCGM_NAMESPACE} describe pods`"))
                # 3. discovery, under an identity that may only read nodes and pods
                manifests.apply(api, [DISCOVERY_RBAC])
            cluster._start_monitoring(detached)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_monitoring(self, detached: bool) -> None:
        root = self.plane.data_dir / "monitoring"
        root.mkdir(exist_ok=True)
        kubeconfig = self.plane.identity_kubeconfig("discovery", DISCOVERY_USER)
        port = processes.free_ports(1)[0]
        log = root / "discovery.log"
        proc = processes.spawn(
            [PYTHON, "-m", "tessera_dev.controlplane.discovery", "--kubeconfig",
             str(kubeconfig), "--listen", f"127.0.0.1:{port}"], log,
            die_with_parent=not detached)
        self._procs.append(proc)
        self.discovery_pid = proc.pid
        url = f"http://127.0.0.1:{port}"
        processes.wait_until(lambda: probes.responds(f"{url}/healthz"), what="discovery",
                             proc=proc, log_path=log, timeout=30)
        self._prometheus = Prometheus.start(
            scrape_configs=kubernetes_scrape_configs(discovery_url=url),
            rules=rule_groups(ALERT_RULES), data_dir=root / "prometheus", detached=detached)
        self.prometheus_url = self._prometheus.url
        self.prometheus_pid = self._prometheus.pid

    def start_kueue(self, binary: Path, release: Path, *, detached: bool = False) -> None:
        """Kueue's controller with its release installed (`kueue` module), stopped with the
        cluster."""
        self._kueue = kueue.Kueue.start(self.plane, binary, release, detached=detached)
        self.kueue_pid = self._kueue.pid

    @property
    def prometheus(self) -> Prometheus:
        if self._prometheus is None:
            assert self.prometheus_url is not None, "the cluster has no Prometheus"
            self._prometheus = Prometheus(self.prometheus_url, self.plane.data_dir, False)
        return self._prometheus

    def stop(self, *, stop_plane: bool = False) -> None:
        """Stop Kueue, Prometheus, discovery and the nodes (each node takes its pods with it);
        the control plane too with stop_plane (else Kueue's webhooks are unregistered first, so
        that the cluster does not call them)."""
        if self.kueue_pid is not None:
            running = self._kueue or kueue.Kueue(self.kueue_pid, self.plane.data_dir)
            if stop_plane:
                running.stop()
            else:
                with self.plane.api_client() as api:
                    running.stop(api)
            self._kueue, self.kueue_pid = None, None
        for pid, program in self._recorded():
            proc = next((p for p in self._procs if p.pid == pid), None)
            if proc is not None:
                processes.stop_group(proc)
            elif processes.runs_command(pid, program):
                processes.stop_group(pid)
        # a stopped node leaves its pods' Memory emptyDirs in the host's /dev/shm, which the
        # data dir's removal does not reach
        for name in self.nodes:
            shutil.rmtree(memory_root(node_dir(self.plane.data_dir, name)), ignore_errors=True)
        self._procs.clear()
        self.nodes.clear()
        self.discovery_pid = self.prometheus_pid = self.prometheus_url = None
        self._prometheus = None
        if stop_plane:
            self.plane.stop()

    # -- shared storage

    def shared_path(self, name: str, namespace: str) -> Path:
        """The folder on this machine that holds the files of shared volume NAME."""
        return self.plane.data_dir / NFS_DIR / NFS_SERVER / namespace / name

    def shared_volume(self, api: client.ApiClient, name: str, namespace: str,
                      size: str = "10Gi") -> str:
        """A ReadWriteMany claim NAME in NAMESPACE on the storage every node shares, bound by the
        controller-manager before this returns; returns the claim's name. A claim NAME that
        exists already (ReadWriteMany, storageClassName "", at most `size`) gets bound to it."""
        core = client.CoreV1Api(api)
        volume_name = f"{namespace}.{name}"
        self.shared_path(name, namespace).mkdir(parents=True, exist_ok=True)
        try:
            claim = core.read_namespaced_persistent_volume_claim(name, namespace,
                                                                 _request_timeout=10)
        except ApiException as exc:
            if exc.status != 404:
                raise
            claim = None
        reserved = {"namespace": namespace, "name": name}
        if claim is not None:
            # bound to the claim's uid, the binder syncs the claim when it sees the volume,
            # not at its next resync (15 s)
            reserved["uid"] = claim.metadata.uid
        _create(lambda: core.create_persistent_volume({
            "metadata": {"name": volume_name},
            "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "claimRef": reserved,
                     "nfs": {"server": NFS_SERVER, "path": f"/{namespace}/{name}"}}},
            _request_timeout=10))
        if claim is None:
            # once the binder has seen the volume (it marks it Available), a new claim finds it
            probes.poll_until(
                lambda: core.read_persistent_volume(volume_name, _request_timeout=10).status.phase,
                lambda phase: phase in ("Available", "Bound"), timeout=BIND_TIMEOUT_S,
                interval=0.2, error=lambda phase: TimeoutError(
                    f"PersistentVolume {volume_name} still {phase} after {BIND_TIMEOUT_S:.0f} s"))
            _create(lambda: core.create_namespaced_persistent_volume_claim(namespace, {
                "metadata": {"name": name},
                "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                         "resources": {"requests": {"storage": size}}}}, _request_timeout=10))
        probes.poll_until(
            lambda: core.read_namespaced_persistent_volume_claim(
                name, namespace, _request_timeout=10),
            lambda got: got.status.phase == "Bound" and got.spec.volume_name == volume_name,
            timeout=BIND_TIMEOUT_S, interval=0.2, error=lambda got: TimeoutError(
                f"claim {namespace}/{name} not bound to PersistentVolume {volume_name} after "
                f"{BIND_TIMEOUT_S:.0f} s (phase {got.status.phase}, volume "
                f"{got.spec.volume_name}); see `kubectl describe pvc -n {namespace} {name}`"))
        return name

    def _recorded(self) -> list[tuple[int, str]]:
        """(pid, a word of its command line that proves the pid is still ours)."""
        found = [(self.prometheus_pid, "prometheus"),
                 (self.discovery_pid, "tessera_dev.controlplane.discovery")]
        found += [(pid, f"--name\0{name}\0") for name, pid in self.nodes.items()]
        found.append((self.kueue_pid, f"--config={kueue.config_path(self.plane.data_dir)}"))
        return [(pid, word) for pid, word in found if pid is not None]

    # -- persistence, for `tessera-dev up` / `tessera-dev down` across processes

    def save(self) -> None:
        self.plane.save()
        (self.plane.data_dir / CLUSTER_FILE).write_text(json.dumps({
            "nodes": self.nodes, "discovery_pid": self.discovery_pid,
            "prometheus_url": self.prometheus_url, "prometheus_pid": self.prometheus_pid,
            "kueue_pid": self.kueue_pid}))

    @classmethod
    def load(cls, data_dir: Path) -> Cluster | None:
        plane = launcher.ControlPlane.load(data_dir)
        if plane is None:
            return None
        try:
            state: dict[str, Any] = json.loads((data_dir / CLUSTER_FILE).read_text())
        except FileNotFoundError:
            return cls(plane)
        return cls(plane, state["nodes"], state["discovery_pid"], state["prometheus_url"],
                   state["prometheus_pid"], state.get("kueue_pid"))

    def is_running(self) -> bool:
        return self.plane.is_running() and all(
            processes.runs_command(pid, word) for pid, word in self._recorded())


def _create(create: Callable[[], Any]) -> None:
    """Create an object; one of that name already there is taken as it is."""
    try:
        create()
    except ApiException as exc:
        if exc.status != 409:
            raise
