"""Start etcd and kube-apiserver on loopback and hand out kubeconfigs and clients for them.

Authentication: an admin client certificate (O=system:masters) and service-account tokens signed
by a generated key (TokenRequest works). Authorization is Node,RBAC, so RBAC is enforced.
There is no controller-manager, scheduler or kubelet: namespaces never finish terminating,
ownerReferences are not garbage-collected and pods stay Pending unless something plays the node.
The ServiceAccount admission plugin is off because no controller creates the `default` service
account of new namespaces; without that, no pod could be created in a fresh namespace.
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

from tessera_operator.controlplane import build, kubeconfig, pki, probes, processes

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc"
STATE_FILE = "controlplane.json"
# written first thing into a data dir, so `up`/`down` know it is theirs even before STATE_FILE
MARKER = ".tessera-controlplane"
SERVERS = ("etcd", "kube-apiserver")


class NotAStateDir(ValueError):
    """A --data-dir that holds something other than a control plane: never deleted."""


def default_data_dir() -> Path:
    """Where `tessera up` keeps its control plane: $TESSERA_STATE_DIR or the XDG state dir."""
    if "TESSERA_STATE_DIR" in os.environ:
        return Path(os.environ["TESSERA_STATE_DIR"]) / "controlplane"
    xdg = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(xdg) / "tessera" / "controlplane"


def check_state_dir(path: Path) -> None:
    """Raise NotAStateDir unless path is absent, empty, or a control plane's state dir.

    `tessera up` and `down` delete their data dir: a mistyped path must not cost a directory.
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
        "--disable-admission-plugins=ServiceAccount",
        "--service-cluster-ip-range=10.96.0.0/16",
        # the `kubernetes` Service's endpoints may not point at loopback; no pod needs them
        "--endpoint-reconciler-type=none",
        "--allow-privileged=true",  # the node power agent runs privileged
        "--enable-priority-and-fairness=false",  # one user; spares two cores some work
        "--profiling=false",
    ]


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
        *, detached: bool = False,
    ) -> ControlPlane:
        """Start a fresh control plane; with no data_dir a temporary one is removed on stop().

        Detached servers outlive this process (`tessera up`); otherwise the kernel kills them
        when this process dies, so a killed test run leaves no servers behind.
        """
        root, owns = processes.work_dir(data_dir, "tessera-cp-")
        try:
            (root / MARKER).touch()
            bins = bin_dir or binaries()
            keys = pki.generate(root / "pki")
            # a port taken by someone else between our pick and the server's bind: new ports
            return processes.with_free_ports(3, lambda ports: cls._launch(
                root, owns, bins, keys, ports, timeout, detached))
        except BaseException:
            if owns:
                shutil.rmtree(root, ignore_errors=True)
            raise

    @classmethod
    def _launch(
        cls, root: Path, owns: bool, bins: Path, keys: pki.Pki, ports: list[int],
        timeout: float, detached: bool,
    ) -> ControlPlane:
        etcd_port, peer_port, port = ports
        plane = cls(root, f"https://127.0.0.1:{port}", root / "kubeconfig", {}, owns)
        try:
            # 1. the admin kubeconfig for this server address
            admin = kubeconfig.certificate_user(keys.admin_cert, keys.admin_key)
            kubeconfig.write(plane.kubeconfig, kubeconfig.render(
                plane.server, keys.ca_cert, admin, pki.ADMIN_USER))
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
        except BaseException:
            plane._stop_processes()
            raise
        return plane

    def _spawn(self, name: str, argv: list[str], log_path: Path, detached: bool) -> None:
        proc = processes.spawn(argv, log_path, die_with_parent=not detached)
        self._procs.append(proc)
        self.pids[name] = proc.pid

    def _stop_processes(self) -> None:
        """Stop the apiserver before etcd."""
        for name in ("kube-apiserver", "etcd"):
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
        """Whether both recorded pids still run etcd and kube-apiserver (not reused since)."""
        return all(name in self.pids and processes.runs(self.pids[name], name)
                   for name in SERVERS)

    def is_ready(self) -> bool:
        return probes.responds(f"{self.server}/readyz", _tls_context(self.keys))

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- persistence, for `tessera up` / `tessera down` across processes

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
