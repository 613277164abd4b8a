"""`tessera-dev sim-node`: one simulated GPU node, in the role of a kubelet with a process runtime.

It registers its Node (GPU capacity and labels), renews its Lease and Ready condition every 10 s,
publishes its GPUs as NVIDIA's DRA driver does (driver.py), runs the pods the scheduler binds to
it as local processes (see pods.py) and serves their logs to the API server on IP:10250. Its
simulated GPUs are served by the dcgm-exporter pod it runs, as a GPU node's are (exporter.py), in
the field names of `--dcgm-generation`. Killed, it simply stops: its pods' processes die with it
and the node lifecycle controller marks it NotReady.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import platform
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from tessera_agents.power.sim_backend import SimBackend
from tessera_dev.simnode import dcgm, faults
from tessera_dev.simnode.containers import unshare_binary
from tessera_dev.simnode.driver import DraDriver
from tessera_dev.simnode.kube import NodeApi, now_rfc3339
from tessera_dev.simnode.pods import GpuPool, IpPool, NodeContext, PodWorker
from tessera_dev.simnode.server import kubelet_endpoint
from tessera_dev.simnode.volumes import SHM, memory_root, writable_tmpfs
from tessera_kube.listwatch import ListWatch

log = logging.getLogger("tessera.simnode")

GPU_RESOURCE = "nvidia.com/gpu"
KUBELET_PORT = 10250
HEARTBEAT_S = 10.0  # the kubelet's node status and lease renewal period
LEASE_S = 40  # the kubelet's lease duration
H200_MEMORY_MIB = 143771  # nvidia.com/gpu.memory of an H200 (141 GB HBM3e)
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")


class UsageError(Exception):
    """A flag with a value the node cannot run with: one line, exit 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tessera-dev sim-node",
        description="Run one simulated GPU node: registers the Node, runs its pods as local "
                    "processes, serves container logs.")
    p.add_argument("--name", required=True, help="Node name (a DNS subdomain)")
    p.add_argument("--dir", required=True, type=Path, help="the node's state directory")
    p.add_argument("--kubeconfig", required=True, type=Path,
                   help="kubeconfig with the node's client certificate (system:node:NAME)")
    p.add_argument("--address", required=True,
                   help="the node's InternalIP, a loopback address such as 127.1.0.1")
    p.add_argument("--gpus", required=True, type=int, help="number of simulated GPUs")
    p.add_argument("--domain-label", help="label naming the node's NVLink domain")
    p.add_argument("--domain", help="the node's NVLink domain (with --domain-label)")
    p.add_argument("--product", default="NVIDIA-H200", help="nvidia.com/gpu.product label")
    p.add_argument("--gpu-memory-mib", type=int, default=H200_MEMORY_MIB,
                   help="nvidia.com/gpu.memory label: each GPU's memory in MiB, as GPU feature "
                        "discovery publishes it (default: an H200's)")
    p.add_argument("--nfs-dir", type=Path,
                   help="folder of the cluster's NFS exports (an nfs PersistentVolume "
                        "{server, path} is NFS_DIR/SERVER/PATH); nodes given the same one share "
                        "them; without it the node serves no nfs volumes")
    p.add_argument("--dcgm-generation", default="4.9", choices=dcgm.GENERATIONS,
                   help="dcgm-exporter field names and labels its exporter pod serves")
    p.add_argument("--kubelet-cert", type=Path, help="serving certificate for IP:10250")
    p.add_argument("--kubelet-key", type=Path, help="its key")
    p.add_argument("--client-ca", type=Path,
                   help="CA whose client certificates may read logs (the API server's)")
    p.add_argument("--kubelet-port", type=int, default=KUBELET_PORT)
    p.add_argument("--cpu", default=str(os.cpu_count() or 1), help="CPU capacity to advertise")
    p.add_argument("--memory", default=None,
                   help="memory capacity to advertise (default: this machine's)")
    p.add_argument("--max-pods", type=int, default=110)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _check(args: argparse.Namespace) -> None:
    if len(args.name) > 253 or not _NAME.fullmatch(args.name):
        raise UsageError(f"--name {args.name!r} is not a valid node name (lowercase DNS "
                         "subdomain)")
    try:
        address = ipaddress.IPv4Address(args.address)
    except ValueError:
        raise UsageError(f"--address {args.address!r} is not an IPv4 address") from None
    if not address.is_loopback or args.address.endswith((".0", ".255")):
        raise UsageError(f"--address {args.address} must be a host address in 127.0.0.0/8 "
                         "(pods get the other addresses of its /24)")
    if args.gpus < 0:
        raise UsageError(f"--gpus must be 0 or more, got {args.gpus}")
    if (args.domain_label is None) != (args.domain is None):
        raise UsageError("--domain-label and --domain go together")
    if args.domain is not None and (len(args.domain) > 63
                                    or not _LABEL_VALUE.fullmatch(args.domain)):
        raise UsageError(f"--domain {args.domain!r} is not a valid label value")
    if not _LABEL_VALUE.fullmatch(args.product) or len(args.product) > 63:
        raise UsageError(f"--product {args.product!r} is not a valid label value")
    if args.gpu_memory_mib < 1:
        raise UsageError(f"--gpu-memory-mib must be at least 1, got {args.gpu_memory_mib}")
    tls = (args.kubelet_cert, args.kubelet_key, args.client_ca)
    if any(tls) and not all(tls):
        raise UsageError("--kubelet-cert, --kubelet-key and --client-ca go together")
    for flag, path in (("--kubeconfig", args.kubeconfig), ("--kubelet-cert", args.kubelet_cert),
                       ("--kubelet-key", args.kubelet_key), ("--client-ca", args.client_ca)):
        if path is not None and not path.is_file():
            raise UsageError(f"{flag} {path}: no such file")
    if not 0 <= args.kubelet_port <= 65535:
        raise UsageError(f"--kubelet-port must be a TCP port, got {args.kubelet_port}")
    for flag, value in (("--cpu", args.cpu), ("--memory", args.memory)):
        if value is not None and not _QUANTITY.fullmatch(value):
            raise UsageError(f"{flag} {value!r} is not a Kubernetes quantity")
    if args.max_pods < 1:
        raise UsageError(f"--max-pods must be positive, got {args.max_pods}")


def _memory() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return f"{line.split()[1]}Ki"
    return "0"


def _arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


class Node:
    """The node process: registration, heartbeat, the pod watch and the pod workers."""

    def __init__(self, args: argparse.Namespace, api: NodeApi) -> None:
        self.args = args
        self.name: str = args.name
        self.dir: Path = args.dir
        self.api = api
        self.gpu_state = SimBackend(count=args.gpus, node=self.name,
                                    state_path=self.dir / faults.GPU_STATE)
        self.gpu_count = len(self.gpu_state.snapshot())
        for index in range(self.gpu_count):  # no pod runs yet: every GPU idles
            self._workload(index, busy=False)
        self.workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()
        self._since = now_rfc3339()
        self.dra = DraDriver(self.name, self.dir, api, self.gpu_state, self._health_changed)
        host, port = self.api.server
        self.context = NodeContext(
            name=self.name, address=args.address, node_dir=self.dir, api=self.api,
            ips=IpPool(args.address),
            gpus=GpuPool(self.gpu_count, self._healthy, self._workload),
            base_env={
                # the project's environment runs every image: its tools come first
                "PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:"
                        "/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": "/root",
                # no service proxy: the `kubernetes` Service's address is the API server's own
                "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(port),
                "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
            },
            forget=self._forget, dra=self.dra, nfs_dir=args.nfs_dir,
            dcgm_generation=args.dcgm_generation,
            shm_dir=memory_root(self.dir) if writable_tmpfs(SHM) else None)

    # -- GPUs

    def _workload(self, index: int, busy: bool) -> None:
        """A GPU draws what its power limit allows while a container holds it, nothing idle."""
        self.gpu_state.set_demand(index, self.gpu_state.spec(index).max_w if busy else 0)

    def _healthy(self) -> set[int]:
        return {gpu.index for gpu in self.gpu_state.snapshot() if gpu.healthy}

    def _health_changed(self) -> None:
        """A GPU's health changed: the pods report their devices' health again."""
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.poke()

    # -- the Node object

    def _labels(self) -> dict[str, str]:
        labels = {
            "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": _arch(), "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.count": str(self.gpu_count),
            "nvidia.com/gpu.product": self.args.product,
            "nvidia.com/gpu.memory": str(self.args.gpu_memory_mib),
        }
        if self.args.domain_label:
            labels[self.args.domain_label] = self.args.domain
        return labels

    def _status(self) -> dict[str, Any]:
        """Capacity, allocatable (less the failed GPUs, as the device plugin reports), Ready."""
        capacity = {"cpu": self.args.cpu, "memory": self.args.memory or _memory(),
                    "pods": str(self.args.max_pods), GPU_RESOURCE: str(self.gpu_count)}
        allocatable = dict(capacity)
        allocatable[GPU_RESOURCE] = str(len(self._healthy()))
        beat = now_rfc3339()

        def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {"type": kind, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": beat, "lastTransitionTime": self._since}

        return {
            "capacity": capacity, "allocatable": allocatable,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory",
                          "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure",
                          "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID",
                          "kubelet has sufficient PID available"),
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": self.args.address},
                          {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.args.kubelet_port}},
        }

    def register(self) -> str:
        """Create or update the Node; returns its uid."""
        uname = os.uname()
        status = self._status()
        status["nodeInfo"] = {
            "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, self.name).hex,
            "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, self.name)),
            "bootID": str(uuid.uuid4()), "kernelVersion": uname.release,
            "osImage": f"tessera simulated node ({platform.system()})",
            "containerRuntimeVersion": "tessera-sim://0.1.0",
            "kubeletVersion": self.api.server_version(), "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": _arch(),
        }
        self.api.register_node({"apiVersion": "v1", "kind": "Node",
                                "metadata": {"name": self.name, "labels": self._labels()},
                                "status": status})
        return self.api.node_uid(self.name)

    def heartbeat(self, node_uid: str) -> None:
        """Renew the Lease and the Ready heartbeat every HEARTBEAT_S, for the process's life."""
        while True:
            try:
                self.api.renew_lease(self.name, node_uid, LEASE_S)
                self.api.patch_node_status(self.name, self._status())
            except Exception:  # the API server may be restarting: the next beat tries again
                log.warning("heartbeat failed", exc_info=True)
            time.sleep(HEARTBEAT_S)

    # -- pods

    def _forget(self, uid: str) -> None:
        with self._lock:
            self.workers.pop(uid, None)

    def _sync(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if worker is not None:
                worker.update(pod)
                return
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                # finished before this process started: nothing runs again; deletion completes
                if pod["metadata"].get("deletionTimestamp"):
                    meta = pod["metadata"]
                    self.api.delete_pod(meta["namespace"], meta["name"], uid)
                return
            worker = self.workers[uid] = PodWorker(self.context, pod)
        worker.start()

    def _removed(self, uid: str) -> None:
        with self._lock:
            worker = self.workers.get(uid)
        if worker is not None:
            worker.removed()

    def watch_pods(self) -> None:
        """Follow the pods bound to this node, for good: list, then watch from the list's
        version; after an expired or failed watch, list again."""
        ListWatch(self.api.core.list_pod_for_all_namespaces,
                  field_selector=f"spec.nodeName={self.name}", on_list=self._listed,
                  on_event=self._event, on_error=self._watch_failed, watch_s=300,
                  timeout_s=self.api.timeout, retry_s=(1.0, 1.0), name="pod watch").run()

    def _listed(self, pods: list[dict[str, Any]]) -> None:
        seen = {pod["metadata"]["uid"] for pod in pods}
        for pod in pods:
            self._sync(pod)
        with self._lock:
            vanished = [uid for uid in self.workers if uid not in seen]
        for uid in vanished:
            self._removed(uid)

    def _event(self, kind: str, pod: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self._sync(pod)
        elif kind == "DELETED":
            self._removed(pod["metadata"]["uid"])

    @staticmethod
    def _watch_failed(exc: Exception) -> None:
        log.info("pod watch ended (%s: %s); listing again", type(exc).__name__, exc)

    def authorize(self, user: str, groups: list[str]) -> bool:
        try:
            return self.api.may_proxy(self.name, user, groups)
        except (ApiException, urllib3.exceptions.HTTPError, OSError):
            log.warning("authorizing %s at the API server failed", user, exc_info=True)
            return False

    def find_logs(self, namespace: str, pod: str, container: str,
                  previous: bool) -> tuple[Path, Callable[[], bool]] | None:
        with self._lock:
            workers = [w for w in self.workers.values()
                       if w.pod["metadata"]["namespace"] == namespace
                       and w.pod["metadata"]["name"] == pod]
        for worker in workers:
            for state in worker.containers:
                if state.name == container:
                    run = state.restart_count - (1 if previous else 0)
                    proc = None if previous else state.proc
                    return (worker.dir / "logs" / container / f"{run}.log",
                            lambda p=proc: p is not None and not p.exited.is_set())
        return None


def _prepare_dir(args: argparse.Namespace) -> None:
    args.dir.mkdir(parents=True, exist_ok=True)
    (args.dir / faults.NODE_PID).write_text(str(os.getpid()))
    for sub in ("root", "pods", "dev"):
        (args.dir / sub).mkdir(exist_ok=True)


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _check(args)
        unshare_binary()
    except (UsageError, RuntimeError) as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    try:
        api = NodeApi(str(args.kubeconfig))
    except Exception as exc:  # the client's loader fails in many ways on a malformed file
        parser.error(f"--kubeconfig {args.kubeconfig} is not a usable kubeconfig: "
                     f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    # 1. the node's directory: pid, host root; the GPU state (kept if present), device files
    try:
        _prepare_dir(args)
    except OSError as exc:
        parser.error(f"--dir {args.dir}: {exc.strerror or exc}")
    try:
        node = Node(args, api)
    except (ValueError, KeyError, OSError) as exc:
        print(f"tessera-dev sim-node: unusable GPU state {args.dir / faults.GPU_STATE}: {exc!r}",
              file=sys.stderr)
        return 1
    for index in range(node.gpu_count):
        faults.device_file(args.dir, index).touch()
    # 2. the endpoint the Node status will name
    try:
        if args.kubelet_cert:
            kubelet_endpoint(args.address, args.kubelet_port, cert=args.kubelet_cert,
                             key=args.kubelet_key, client_ca=args.client_ca,
                             find_logs=node.find_logs, authorize=node.authorize)
    except OSError as exc:
        print(f"tessera-dev sim-node: cannot listen on {args.address}: {exc}", file=sys.stderr)
        return 1
    # 3. the Node, its Lease and heartbeat
    try:
        node_uid = node.register()
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        print(f"tessera-dev sim-node: cannot register Node {args.name}: {exc}", file=sys.stderr)
        return 1
    threading.Thread(target=node.heartbeat, args=(node_uid,), name="heartbeat",
                     daemon=True).start()
    # 4. its GPUs as its DRA driver publishes them (the driver's own loop retries a failure)
    threading.Thread(target=node.dra.run, name="dra-driver", daemon=True).start()
    log.info("node %s registered at %s with %d GPUs", args.name, args.address, node.gpu_count)
    # 5. the pods bound to it, until the process is killed
    node.watch_pods()
    return 0
