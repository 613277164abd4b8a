"""Start the control plane on loopback (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler) and hand out kubeconfigs and clients for it.

Each component has its own identity, as on a real cluster: client certificates for the scheduler
(system:kube-scheduler) and the controller-manager (system:kube-controller-manager), which runs
its controllers under their own service accounts; the apiserver's bootstrap RBAC binds them.
People use an admin client certificate (O=system:masters); workloads use service-account tokens
signed by a generated key. Authorization is Node,RBAC with the NodeRestriction admission plugin,
so a (simulated) node may only touch its own Node, Lease and pods. The apiserver reaches the
nodes' kubelet endpoints (`kubectl logs`) with its own client certificate.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tessera_dev import probes, processes
from tessera_dev.controlplane import build, kubeconfig, pki

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc"
STATE_FILE = "controlplane.json"
# written first thing into a data dir, so `up`/`down` know it is theirs even before STATE_FILE
MARKER = ".tessera-controlplane"
SERVERS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
# Stopped in this order: the clients of the apiserver first, etcd last.
STOP_ORDER = ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")
# How long the node lifecycle controller waits for a node's heartbeat before marking it NotReady.
# Kubernetes' default is 50 s; a local cluster answers `tessera-dev fail-node` within half that,
# still two missed 10 s Lease renewals.
NODE_MONITOR_GRACE = "20s"


class NotAStateDir(ValueError):
    """A --data-dir that holds something other than a control plane: never deleted."""


def check_state_dir(path: Path) -> None:
    """Raise NotAStateDir unless path is absent, empty, or a control plane's state dir.

    `tessera-dev up` and `down` delete their data dir: a mistyped path must not cost a directory.
    """
    if not path.exists():
        return
    if path.is_dir() and (not any(path.iterdir()) or (path / STATE_FILE).exists()
                          or (path / MARKER).exists()):
        return
    raise NotAStateDir(f"{path} is not a control plane state directory (it has neither "
                       f"{STATE_FILE} nor {MARKER}); refusing to use or delete it")


def remove_state_dir(path: Path) -> None:
    check_state_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def prebuilt() -> Path | None:
    """$TESSERA_BIN_DIR if set (binaries built elsewhere), else a cached build, else None."""
    given = os.environ.get("TESSERA_BIN_DIR")
    return Path(given) if given else build.find_cached()


def helm() -> Path | None:
    """helm from $TESSERA_BIN_DIR if it holds one (built elsewhere with the control plane), else
    the cached build, else None."""
    given = os.environ.get("TESSERA_BIN_DIR")
    if given and (Path(given) / "helm").is_file():
        return Path(given) / "helm"
    return build.find_helm()


def kueue(log: Callable[[str], object] = print) -> Path:
    """Kueue's controller: $TESSERA_KUEUE_BIN if set (built elsewhere, of
    build.KUEUE_VERSION), else the cached build, else one built now (many minutes)."""
    given = os.environ.get("TESSERA_KUEUE_BIN")
    return Path(given) if given else build.ensure_kueue(log=log)


def binaries(log: Callable[[str], object] = print) -> Path:
    """The prebuilt binaries, or a registry build made now (many minutes the first time)."""
    return prebuilt() or build.ensure(log=log)


def _etcd_argv(binary: Path, data: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(binary), "--name=tessera", f"--data-dir={data}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=tessera={peer}",
        # a throwaway single-member store: durability across power loss buys nothing here
        "--unsafe-no-fsync", "--log-level=warn",
    ]


def _apiserver_argv(binary: Path, keys: pki.Pki, etcd_port: int, port: int) -> list[str]:
    return [
        str(binary), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
        f"--tls-cert-file={keys.serving_cert}", f"--tls-private-key-file={keys.serving_key}",
        f"--client-ca-file={keys.ca_cert}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--api-audiences={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={keys.sa_pub}",
        f"--service-account-signing-key-file={keys.sa_key}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        f"--kubelet-client-certificate={keys.kubelet_client_cert}",
        f"--kubelet-client-key={keys.kubelet_client_key}",
        "--kubelet-preferred-address-types=InternalIP",
        "--service-cluster-ip-range=10.96.0.0/16",
        # the `kubernetes` Service's endpoints may not point at loopback; no pod needs them
        "--endpoint-reconciler-type=none",
        "--allow-privileged=true",  # the node power agent runs privileged
        "--enable-priority-and-fairness=false",  # one user; spares two cores some work
        "--profiling=false",
    ]


def _component_argv(binary: Path, kubeconfig_path: Path, port: int) -> list[str]:
    """Flags the scheduler and the controller-manager share: one kubeconfig for everything,
    a health endpoint on loopback, and no leader election (one replica)."""
    return [
        str(binary), f"--kubeconfig={kubeconfig_path}",
        f"--authentication-kubeconfig={kubeconfig_path}",
        f"--authorization-kubeconfig={kubeconfig_path}",
        "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false",
        "--profiling=false",
    ]


def _controller_manager_argv(binary: Path, keys: pki.Pki, kubeconfig_path: Path,
                             port: int, node_lifecycle: bool) -> list[str]:
    return [
        *_component_argv(binary, kubeconfig_path, port),
        # the token controller signs with the key the apiserver verifies, and publishes the CA
        # as kube-root-ca.crt in every namespace
        f"--service-account-private-key-file={keys.sa_key}", f"--root-ca-file={keys.ca_cert}",
        "--use-service-account-credentials=true",
        "--service-cluster-ip-range=10.96.0.0/16",
        f"--node-monitor-grace-period={NODE_MONITOR_GRACE}", "--node-monitor-period=2s",
        *([] if node_lifecycle else ["--controllers=*,-node-lifecycle-controller"]),
    ]


def _component_ready(port: int) -> bool:
    # the components serve /healthz with a self-signed certificate to anonymous callers
    return probes.responds(f"https://127.0.0.1:{port}/healthz",
                           ssl._create_unverified_context())


def _tls_context(keys: pki.Pki) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(keys.ca_cert))
    context.load_cert_chain(str(keys.admin_cert), str(keys.admin_key))
    return context


@dataclass
class ControlPlane:
    """A running etcd + kube-apiserver pair; a context manager that stops them on exit."""

    data_dir: Path
    server: str
    kubeconfig: Path
    pids: dict[str, int]
    owns_data_dir: bool = False
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def keys(self) -> pki.Pki:
        return pki.Pki.at(self.data_dir / "pki")

    @classmethod
    def start(
        cls, data_dir: Path | None = None, bin_dir: Path | None = None, timeout: float = 120.0,
        *, detached: bool = False, node_lifecycle: bool = True,
    ) -> ControlPlane:
        """Start a fresh control plane; with no data_dir a temporary one is removed on stop().

        Detached servers outlive this process (`tessera-dev up`); otherwise the kernel kills them
        when this process dies, so a killed test run leaves no servers behind. Without
        `node_lifecycle` no controller marks nodes that never heartbeat (registered Node objects
        with no node process stay Ready, as heartbeating ones do).
        """
        root, owns = processes.work_dir(data_dir, "tessera-cp-")
        try:
            (root / MARKER).touch()
            bins = bin_dir or binaries()
            keys = pki.generate(root / "pki")
            # a port taken by someone else between our pick and the server's bind: new ports
            return processes.with_free_ports(5, lambda ports: cls._launch(
                root, owns, bins, keys, ports, timeout, detached, node_lifecycle))
        except BaseException:
            if owns:
                shutil.rmtree(root, ignore_errors=True)
            raise

    @classmethod
    def _launch(
        cls, root: Path, owns: bool, bins: Path, keys: pki.Pki, ports: list[int],
        timeout: float, detached: bool, node_lifecycle: bool,
    ) -> ControlPlane:
        etcd_port, peer_port, port, cm_port, scheduler_port = ports
        plane = cls(root, f"https://127.0.0.1:{port}", root / "kubeconfig", {}, owns)
        try:
            # 1. kubeconfigs for this server address: the admin's and each component's
            admin = kubeconfig.certificate_user(keys.admin_cert, keys.admin_key)
            kubeconfig.write(plane.kubeconfig, kubeconfig.render(
                plane.server, keys.ca_cert, admin, pki.ADMIN_USER))
            components = {name: plane.identity_kubeconfig(name, f"system:{name}")
                          for name in ("kube-controller-manager", "kube-scheduler")}
            # 2. etcd on a fresh store (a failed try's store names its old peer address),
            #    ready when its health endpoint answers
            shutil.rmtree(root / "etcd", ignore_errors=True)
            etcd_log = root / "etcd.log"
            plane._spawn("etcd", _etcd_argv(bins / "etcd", root / "etcd", etcd_port, peer_port),
                         etcd_log, detached)
            processes.wait_until(
                lambda: probes.responds(f"http://127.0.0.1:{etcd_port}/health"), what="etcd",
                proc=plane._procs[-1], log_path=etcd_log, timeout=timeout)
            # 3. kube-apiserver, ready when /readyz passes and the default namespace exists
            api_log = root / "kube-apiserver.log"
            plane._spawn("kube-apiserver",
                         _apiserver_argv(bins / "kube-apiserver", keys, etcd_port, port), api_log,
                         detached)
            tls = _tls_context(keys)
            processes.wait_until(
                lambda: probes.responds(f"{plane.server}/readyz", tls)
                and probes.responds(f"{plane.server}/api/v1/namespaces/default", tls),
                what="kube-apiserver", proc=plane._procs[-1], log_path=api_log, timeout=timeout)
            # 4. the controller-manager and the scheduler, started together, each ready when its
            #    health endpoint answers
            argvs = {
                "kube-controller-manager": _controller_manager_argv(
                    bins / "kube-controller-manager", keys, components["kube-controller-manager"],
                    cm_port, node_lifecycle),
                "kube-scheduler": _component_argv(
                    bins / "kube-scheduler", components["kube-scheduler"], scheduler_port),
            }
            for name, argv in argvs.items():
                plane._spawn(name, argv, root / f"{name}.log", detached)
            for name, component_port in (("kube-controller-manager", cm_port),
                                         ("kube-scheduler", scheduler_port)):
                proc = next(p for p in plane._procs if p.pid == plane.pids[name])
                processes.wait_until(lambda p=component_port: _component_ready(p), what=name,
                                     proc=proc, log_path=root / f"{name}.log", timeout=timeout)
        except BaseException:
            plane._stop_processes()
            raise
        return plane

    def _spawn(self, name: str, argv: list[str], log_path: Path, detached: bool) -> None:
        proc = processes.spawn(argv, log_path, die_with_parent=not detached)
        self._procs.append(proc)
        self.pids[name] = proc.pid

    def _stop_processes(self) -> None:
        """Stop the apiserver's clients, then the apiserver, then etcd."""
        for name in STOP_ORDER:
            pid = self.pids.get(name)
            proc = next((p for p in self._procs if p.pid == pid), None)
            if proc is not None:
                processes.stop_group(proc)
            # a pid from a saved state may have been reused since: only kill our own binary
            elif pid is not None and processes.runs(pid, name):
                processes.stop_group(pid)
        self.pids.clear()

    def stop(self) -> None:
        """Stop the servers, and remove the data dir if start() created it."""
        self._stop_processes()
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def is_running(self) -> bool:
        """Whether every recorded pid still runs its server (not reused since)."""
        return all(name in self.pids and processes.runs(self.pids[name], name)
                   for name in SERVERS)

    def is_ready(self) -> bool:
        return probes.responds(f"{self.server}/readyz", _tls_context(self.keys))

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- persistence, for `tessera-dev up` / `tessera-dev down` across processes

    def save(self) -> Path:
        path = self.data_dir / STATE_FILE
        path.write_text(json.dumps({
            "server": self.server, "kubeconfig": str(self.kubeconfig), "pids": self.pids}))
        return path

    @classmethod
    def load(cls, data_dir: Path) -> ControlPlane | None:
        try:
            state = json.loads((data_dir / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        return cls(data_dir, state["server"], Path(state["kubeconfig"]), state["pids"])

    # -- clients

    def api_client(self) -> ApiClient:
        """A kubernetes client authenticated as the cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def identity_kubeconfig(self, name: str, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig file data_dir/NAME.kubeconfig with a client certificate for `user` in
        `groups` (a component, a simulated node); the certificate is made on first use."""
        keys = self.keys
        cert, key = keys.ca_cert.parent / f"{name}.crt", keys.ca_cert.parent / f"{name}.key"
        if not cert.exists():
            cert, key = pki.client_certificate(keys, keys.ca_cert.parent, name, user, groups)
        path = self.data_dir / f"{name}.kubeconfig"
        kubeconfig.write(path, kubeconfig.render(
            self.server, keys.ca_cert, kubeconfig.certificate_user(cert, key), user))
        return path

    def token_kubeconfig(self, token: str, user_name: str) -> dict:
        return kubeconfig.render(self.server, self.keys.ca_cert, kubeconfig.token_user(token),
                                 user_name)

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A TokenRequest token for a service account, creating the account if it is missing."""
        from kubernetes import client

        with self.api_client() as admin:
            core = client.CoreV1Api(admin)
            try:
                core.create_namespaced_service_account(
                    namespace, {"metadata": {"name": name}})
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
            request = {"spec": {"audiences": [SERVICE_ACCOUNT_ISSUER],
                                "expirationSeconds": seconds}}
            return core.create_namespaced_service_account_token(name, namespace, request) \
                .status.token

    def service_account_client(self, namespace: str, name: str) -> ApiClient:
        """A kubernetes client that acts as the given service account (subject to RBAC)."""
        from kubernetes import config

        token = self.service_account_token(namespace, name)
        user = f"system:serviceaccount:{namespace}:{name}"
        return config.new_client_from_config_dict(self.token_kubeconfig(token, user))
