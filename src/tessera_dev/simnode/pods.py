"""One pod on the simulated node, from binding to deletion: the kubelet's pod worker.

Each pod gets a thread that owns it: it admits the pod (volumes, image entrypoints, an address,
GPUs), fills its volumes, runs the init containers in order and then the app containers, applies
the restart policy with back-off, probes, reports status, and on deletion stops the containers
(SIGTERM, the grace period, SIGKILL) and removes the pod object. The thread lives as long as the
pod's processes: they are started from it and die with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from tessera_dev.simnode import dra, faults, podspec
from tessera_dev.simnode.containers import Prober, Process, probe, stop_all
from tessera_dev.simnode.driver import PREPARE_REASON, DraDriver
from tessera_dev.simnode.exporter import GENERATION_ENV
from tessera_dev.simnode.kube import NodeApi, now_rfc3339
from tessera_dev.simnode.podspec import NotYetAvailable, PodSpecError
from tessera_dev.simnode.volumes import PodVolumes, check_volumes

log = logging.getLogger(__name__)

RETRY_S = 2.0  # a pod waiting for an object it references looks again this often
# How long a failed pull shows as ErrImagePull before its back-off (the kubelet's next sync)
PULL_ERROR_SHOWN_S = 1.0
DEFAULT_GRACE_S = 30.0
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class Exhausted(Exception):
    """A pool has no free entry left."""


class IpPool:
    """Pod addresses: the node's /24 on loopback, except the node's own address."""

    def __init__(self, node_address: str) -> None:
        prefix = node_address.rsplit(".", 1)[0]
        self._free = [f"{prefix}.{i}" for i in range(1, 255) if f"{prefix}.{i}" != node_address]
        self._used: dict[str, str] = {}
        self._lock = threading.Lock()

    def allocate(self, uid: str) -> str:
        with self._lock:
            if uid not in self._used:
                if not self._free:
                    raise Exhausted("no pod address left in the node's /24")
                self._used[uid] = self._free.pop(0)
            return self._used[uid]

    def release(self, uid: str) -> None:
        with self._lock:
            address = self._used.pop(uid, None)
            if address is not None:
                self._free.append(address)
                self._free.sort(key=lambda a: int(a.rsplit(".", 1)[1]))


class GpuPool:
    """The device plugin's job: concrete healthy GPU indices for each GPU-requesting container."""

    def __init__(self, count: int, healthy: Callable[[], set[int]],
                 busy: Callable[[int, bool], None] = lambda index, busy: None) -> None:
        self._count = count
        self._healthy = healthy
        self._busy = busy  # told when a GPU gets a workload (True) or loses it (False)
        self._used: dict[int, str] = {}
        self._lock = threading.Lock()

    def allocate(self, owner: str, count: int) -> list[int]:
        if count == 0:
            return []
        with self._lock:
            healthy = self._healthy()
            free = [i for i in range(self._count) if i in healthy and i not in self._used]
            if len(free) < count:
                raise Exhausted(f"asked for {count} nvidia.com/gpu, {len(free)} free and "
                                "healthy on this node")
            for index in free[:count]:
                self._used[index] = owner
                self._busy(index, True)
            return free[:count]

    def take(self, owner: str, indices: list[int]) -> list[int]:
        """Hold the GPUs a DRA driver was allocated for `owner` (the scheduler chose them)."""
        with self._lock:
            taken = {i: self._used[i] for i in indices if self._used.get(i, owner) != owner}
            if taken:
                raise Exhausted(f"GPUs {sorted(taken)} allocated to this pod are held by "
                                "another pod on this node")
            for index in indices:
                if index not in self._used:
                    self._used[index] = owner
                    self._busy(index, True)
            return indices

    def release(self, owner: str) -> None:
        with self._lock:
            for index in [i for i, o in self._used.items() if o == owner]:
                del self._used[index]
                self._busy(index, False)


@dataclass
class NodeContext:
    """What every pod worker of one node shares."""

    name: str
    address: str
    node_dir: Path
    api: NodeApi
    ips: IpPool
    gpus: GpuPool
    base_env: dict[str, str]  # PATH, HOME, KUBERNETES_SERVICE_HOST/PORT
    forget: Callable[[str], None] = lambda uid: None  # called when a worker is done
    dra: DraDriver | None = None  # the node's DRA driver: claims and device health
    nfs_dir: Path | None = None  # the cluster's NFS exports, shared by its nodes
    shm_dir: Path | None = None  # the node's folder on a tmpfs, for Memory emptyDirs
    dcgm_generation: str = "4.9"  # the field names its dcgm-exporter serves (exporter.py)

    @property
    def gpu_state(self) -> Path:
        return self.node_dir / faults.GPU_STATE

    @property
    def device_dir(self) -> Path:
        return self.node_dir / "dev"

    def pod_dir(self, pod: Mapping[str, Any]) -> Path:
        meta = pod["metadata"]
        return self.node_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"

    def memory_dir(self, pod: Mapping[str, Any]) -> Path | None:
        """The pod's folder on the node's tmpfs; None without one."""
        return None if self.shm_dir is None else self.shm_dir / self.pod_dir(pod).name


@dataclass
class ContainerState:
    """One container of the pod, across its restarts."""

    spec: Mapping[str, Any]
    init: bool
    restart_count: int = 0
    crashes: int = 0  # consecutive, for the back-off
    proc: Process | None = None
    container_id: str | None = None
    state: dict[str, Any] = field(default_factory=lambda: {
        "waiting": {"reason": "PodInitializing"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    restart_at: float | None = None
    done: bool = False  # exited and will not run again
    gpus: list[int] = field(default_factory=list)
    # the devices of the pod's claims it names, by its allocatedResourcesStatus entry
    claims: list[tuple[str, list[dra.Device]]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    readiness: Prober | None = None
    liveness: Prober | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def ready(self) -> bool:
        running = "running" in self.state
        return running and (self.readiness is None or self.readiness.healthy)

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name, "image": self.spec.get("image", ""), "imageID": "",
            "containerID": self.container_id,
            "ready": False if self.init else self.ready,
            "started": "running" in self.state,
            "restartCount": self.restart_count, "state": self.state,
            "lastState": self.last_state,
        }

    def outcome(self) -> podspec.Outcome:
        code = self.state.get("terminated", {}).get("exitCode")
        return podspec.Outcome(started=self.restart_count > 0 or self.proc is not None,
                               running=self.proc is not None and not self.proc.exited.is_set(),
                               exit_code=code, will_restart=not self.done)


class PodWorker:
    """Runs one pod in a thread of its own; `update()` hands it newer versions of the object,
    `removed()` its end."""

    def __init__(self, node: NodeContext, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.thread = threading.Thread(target=self.run, daemon=True,
                                       name=f"pod-{meta['namespace']}/{meta['name']}")
        self.node = node
        self.pod = pod
        self.uid: str = meta["uid"]
        self.dir = node.pod_dir(pod)
        self.memory_dir = node.memory_dir(pod)
        self._wake = threading.Event()
        self._gone = False
        self._sent: dict[str, Any] | None = None
        self._pod_ip = ""
        self._start_time = now_rfc3339()
        self._phase_reason: tuple[str, str] | None = None
        self._waiting: tuple[str, str] | None = None  # pod-level wait (a missing reference)
        spec = pod["spec"]
        self.inits = [ContainerState(c, True) for c in spec.get("initContainers") or []]
        self.apps = [ContainerState(c, False) for c in spec["containers"]]
        self._inits_done = not self.inits
        self._init_failed = False
        self._volumes: PodVolumes | None = None
        self._tokens_due = float("inf")
        self._unpublished = False  # the last status update failed

    def start(self) -> None:
        self.thread.start()

    # -- events from the node's pod watch

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self._wake.set()

    def poke(self) -> None:
        """Have the worker publish its status again (a device's health changed)."""
        self._wake.set()

    def removed(self) -> None:
        self._gone = True
        self._wake.set()

    @property
    def deleting(self) -> bool:
        return self._gone or bool(self.pod["metadata"].get("deletionTimestamp"))

    @property
    def grace_s(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
        return 0.0 if self._gone else float(grace)

    @property
    def containers(self) -> list[ContainerState]:
        return self.inits + self.apps

    # -- the worker

    def run(self) -> None:
        try:
            self._live()
        except Exception as exc:  # a bug here must cost this pod, never the node
            log.exception("pod %s failed in the node", self.name)
            self._fail("NodeError", f"the simulated node could not run the pod: {exc}")
        finally:
            running = [c for c in self.containers if c.proc and not c.proc.exited.is_set()]
            for container in running:
                self._event("Normal", "Killing", f"Stopping container {container.name}",
                            container.name)
            stop_all([c.proc for c in self.containers if c.proc], self.grace_s)
            for container in self.containers:
                if "running" in container.state:
                    self._best_effort(lambda c=container: self._exited(c, restarts=False))
            self._release()
        with contextlib.suppress(Exception):
            self._publish()
        while not self.deleting:  # a finished pod stays until it is deleted
            self._wait(None)
        if not self._gone:
            self._best_effort(lambda: self.node.api.delete_pod(
                self.pod["metadata"]["namespace"], self.pod["metadata"]["name"], self.uid))
        # emptyDirs go with the pod, those on the node's tmpfs too
        for folder in (self.dir / "volumes", self.memory_dir):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self.node.forget(self.uid)

    def _live(self) -> None:
        try:
            self._admit()
            if not self._prepare_claims() or not self._fill_volumes():
                return
            if self._run_inits():
                self._run_apps()
        except PodSpecError as exc:
            self._fail(exc.reason, exc.message)

    def _admit(self) -> None:
        """1. refuse what cannot run; 2. an address; 3. GPUs per container; 4. report Pending."""
        spec = self.pod["spec"]
        check_volumes(self.pod)
        for container in self.containers:
            if container.init and container.spec.get("restartPolicy"):
                raise PodSpecError("UnsupportedContainer", f"init container {container.name!r} "
                                   "is a sidecar (restartPolicy set), which the simulated node "
                                   "does not run")
        if spec.get("hostNetwork"):
            self._pod_ip = self.node.address
        else:
            self._pod_ip = self._allocate(lambda: self.node.ips.allocate(self.uid))
        for container in self.containers:
            count = podspec.gpu_request(container.spec)
            container.gpus = self._allocate(
                lambda n=count: self.node.gpus.allocate(self.uid, n))
        self._volumes = PodVolumes(
            self.pod, self.dir, self.node.node_dir / "root",
            read_object=self.node.api.read_object, read_storage=self.node.api.read_storage,
            issue_token=lambda account, audience, seconds: self.node.api.request_token(
                self.pod, account, audience, seconds),
            pod_ip=self._pod_ip, host_ip=self.node.address, memory_dir=self.memory_dir,
            nfs_root=self.node.nfs_dir)
        self._publish()

    def _prepare_claims(self) -> bool:
        """The kubelet's PrepareResources: each container gets the devices the scheduler
        allocated to the claims it names, and nothing else; False if the pod went away while
        a claim was not allocated yet."""
        if not self.pod["spec"].get("resourceClaims"):
            return True
        if self.node.dra is None:
            raise PodSpecError("UnsupportedResourceClaims",
                               "the pod has resource claims and this node runs no DRA driver")
        driver = self.node.dra
        devices: dict[str, list[dra.Device]] = {}
        if not self._retryable(lambda: devices.update(driver.prepare(self.pod)),
                               PREPARE_REASON):
            return False
        for container in self.containers:
            container.claims = dra.container_devices(container.spec, devices)
            indices = sorted({d.index for _, found in container.claims for d in found})
            held = self._allocate(lambda i=indices: self.node.gpus.take(self.uid, i))
            container.gpus = sorted({*container.gpus, *held})
        self._publish()
        return True

    @staticmethod
    def _allocate(take: Callable[[], Any]) -> Any:
        try:
            return take()
        except Exhausted as exc:
            # the scheduler counted the node's allocatable; the kubelet's answer to a mismatch
            raise PodSpecError("UnexpectedAdmissionError", str(exc)) from exc

    def _retryable(self, action: Callable[[], Any], reason: str) -> bool:
        """Run action until it stops waiting for a missing object or a refusing API server
        (the Node authorizer learns of a new pod's references a moment after the pod);
        False if the pod went away meanwhile."""
        while not self.deleting:
            try:
                action()
            except (NotYetAvailable, ApiException, urllib3.exceptions.HTTPError) as exc:
                why = (exc.reason, exc.message) if isinstance(exc, NotYetAvailable) else \
                    (reason, f"API server: {exc}".strip())
                if self._waiting != why:
                    log.info("pod %s waits: %s: %s", self.name, *why)
                    self._event("Warning", *why)
                    self._waiting = why
                    self._publish()
                self._wait(RETRY_S)
                continue
            self._waiting = None
            return True
        return False

    def _fill_volumes(self) -> bool:
        assert self._volumes is not None
        filled = self._retryable(self._volumes.prepare, "FailedMount")
        self._tokens_due = self._volumes.due
        return filled

    def _run_inits(self) -> bool:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for container in self.inits:
            while True:
                if not self._start(container):
                    return False
                while not container.proc.exited.is_set():  # type: ignore[union-attr]
                    if self.deleting:
                        return False
                    self._wait(None)
                code = self._exited(container, restarts=policy != "Never")
                if code == 0:
                    break
                if policy == "Never":
                    self._init_failed = True
                    self._publish()
                    return False
                if not self._backoff(container):
                    return False
        self._inits_done = True
        return True

    def _run_apps(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for container in self.apps:
            if not self._start(container):
                return
        while not self.deleting:
            now = time.monotonic()
            for container in self.apps:
                proc = container.proc
                if proc is not None and proc.exited.is_set() and "running" in container.state:
                    restart = podspec.restarts(policy, proc.exit_code or 0) \
                        and proc.start_error is None
                    self._exited(container, restarts=restart)
                    if restart:
                        container.restart_at = now + self._crashed(container)
                    else:
                        container.done = True
                if container.restart_at is not None and now >= container.restart_at:
                    container.restart_at = None
                    container.restart_count += 1
                    if not self._start(container):
                        return
                self._probe(container, now)
            self._refresh_tokens()
            self._publish()
            if all(c.done for c in self.apps) or self._phase_reason is not None:
                return
            self._wait(self._next_deadline())

    # -- containers

    def _start(self, container: ContainerState) -> bool:
        """Start one container; False if the pod went away while it waited for its image or a
        reference."""
        def build() -> None:
            container.env = self._env(container)
        if not self._pulled(container) or \
                not self._retryable(build, "CreateContainerConfigError"):
            return False
        argv = podspec.container_argv(container.spec, container.env)
        spec = container.spec
        run = f"{container.name}/{container.restart_count}"
        container.proc = Process.start(
            run_dir=self.dir / "run" / run, log=self.dir / "logs" / f"{run}.log", argv=argv,
            env=container.env, cwd=spec.get("workingDir") or "/", mounts=self._mounts(spec),
            devices=[faults.device_file(self.node.node_dir, i) for i in container.gpus],
            hostname=self._hostname(), wake=self._wake)
        container.container_id = self._container_id(container)
        container.state = {"running": {"startedAt": container.proc.started_at}}
        self._event("Normal", "Started", f"Started container {container.name}", container.name)
        now = time.monotonic()
        container.readiness = Prober(spec["readinessProbe"], now, healthy=False) \
            if spec.get("readinessProbe") else None
        container.liveness = Prober(spec["livenessProbe"], now, healthy=True) \
            if spec.get("livenessProbe") else None
        self._publish()
        return True

    def _pulled(self, container: ContainerState) -> bool:
        """Whether the container's image is one the node runs; if not, it waits as a kubelet
        waits for an image it cannot pull, until the pod is deleted (False then): ErrImagePull
        at each try, ImagePullBackOff between tries, the back-off doubling from 10 s to its
        cap as a crashing container's does."""
        why = podspec.unpullable(container.spec)
        if why is None:
            return True
        image = container.spec.get("image", "")
        tries = 0
        while not self.deleting:
            tries += 1
            container.state = {"waiting": {"reason": "ErrImagePull", "message": why}}
            self._event("Warning", "Failed", f'Failed to pull image "{image}": {why}',
                        container.name)
            self._publish()
            self._wait(PULL_ERROR_SHOWN_S)
            container.state = {"waiting": {"reason": "ImagePullBackOff", "message":
                                           f'Back-off pulling image "{image}": {why}'}}
            self._event("Normal", "BackOff", f'Back-off pulling image "{image}"',
                        container.name)
            self._publish()
            deadline = time.monotonic() + podspec.restart_delay(tries + 1)
            while not self.deleting and time.monotonic() < deadline:
                self._wait(deadline - time.monotonic())
        return False

    def _container_id(self, container: ContainerState) -> str:
        return f"tessera-sim://{self.uid}/{container.name}/{container.restart_count}"

    def _exited(self, container: ContainerState, *, restarts: bool) -> int:
        """Record a container's exit; returns its exit code."""
        proc = container.proc
        assert proc is not None and proc.exit_code is not None
        code = proc.exit_code
        error = proc.start_error
        terminated = {
            "exitCode": code, "reason": "StartError" if error else podspec.exit_reason(code),
            "startedAt": proc.started_at, "finishedAt": now_rfc3339(),
            "containerID": self._container_id(container)}
        if error:
            terminated["message"] = error
        if container.liveness is not None and not container.liveness.healthy:
            terminated["message"] = "killed after its liveness probe failed"
        container.last_state = {"terminated": terminated} if restarts else container.last_state
        container.state = {"terminated": terminated}
        if error:
            self._event("Warning", "Failed", error, container.name)
        if error and not container.init:
            # a command that cannot run will not run on a retry either
            self._phase_reason = ("ContainerCannotRun", f"container {container.name!r}: {error}")
        if proc.started_mono + podspec.BACKOFF_RESET_S < time.monotonic():
            container.crashes = 0
        container.readiness = container.liveness = None
        self._publish()
        return code

    def _crashed(self, container: ContainerState) -> float:
        """Count a crash; returns the back-off before the restart (waiting, if not zero)."""
        container.crashes += 1
        delay = podspec.restart_delay(container.crashes)
        if delay > 0:
            self._event("Warning", "BackOff", f"Back-off restarting failed container "
                        f"{container.name} in pod {self.name}", container.name)
            container.state = {"waiting": {"reason": "CrashLoopBackOff", "message":
                                           f"back-off {delay:.0f}s restarting failed container="
                                           f"{container.name} pod={self.name}"}}
        return delay

    def _backoff(self, container: ContainerState) -> bool:
        deadline = time.monotonic() + self._crashed(container)
        self._publish()
        while time.monotonic() < deadline:
            if self.deleting:
                return False
            self._wait(deadline - time.monotonic())
        container.restart_count += 1
        return True

    def _probe(self, container: ContainerState, now: float) -> None:
        proc = container.proc
        if proc is None or proc.exited.is_set():
            return
        ports = {p["name"]: p["containerPort"] for p in container.spec.get("ports") or []
                 if p.get("name")}
        for kind, prober in (("Readiness", container.readiness),
                             ("Liveness", container.liveness)):
            if prober is None or not prober.due(now):
                continue
            ok = probe(prober.spec, pod_ip=self._pod_ip, ports=ports, env=container.env,
                       shim_pid=proc.shim_pid())
            if not ok:
                self._event("Warning", "Unhealthy", f"{kind} probe failed", container.name)
            prober.record(ok, time.monotonic())
        if container.liveness is not None and not container.liveness.healthy:
            self._event("Normal", "Killing", f"Container {container.name} failed liveness "
                        "probe, will be restarted", container.name)
            grace = container.liveness.spec.get("terminationGracePeriodSeconds",
                                                self.pod["spec"].get(
                                                    "terminationGracePeriodSeconds",
                                                    DEFAULT_GRACE_S))
            stop_all([proc], float(grace))

    def _refresh_tokens(self) -> None:
        if self._volumes is None or time.monotonic() < self._tokens_due:
            return
        try:
            self._tokens_due = self._volumes.refresh()
        except (ApiException, urllib3.exceptions.HTTPError, OSError):
            # the current token still has a fifth of its life: try again shortly
            log.warning("pod %s: token renewal failed", self.name, exc_info=True)
            self._tokens_due = time.monotonic() + RETRY_S

    def _next_deadline(self) -> float | None:
        times = [c.restart_at for c in self.apps if c.restart_at is not None]
        if self._unpublished:
            times.append(time.monotonic() + RETRY_S)
        times += [p.next_at for c in self.apps for p in (c.readiness, c.liveness) if p]
        times.append(self._tokens_due)
        finite = [t for t in times if t != float("inf")]
        return max(0.0, min(finite) - time.monotonic()) if finite else None

    def _hostname(self) -> str:
        """The container's host name, as a kubelet gives it: the node's on the host network,
        else the pod's `hostname` or name (processes tell each other apart by host and PID)."""
        spec = self.pod["spec"]
        return self.node.name if spec.get("hostNetwork") else \
            spec.get("hostname") or self.pod["metadata"]["name"]

    def _env(self, container: ContainerState) -> dict[str, str]:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        base = dict(self.node.base_env)
        base["HOSTNAME"] = self._hostname()
        namespace = meta["namespace"]

        def lookup(kind: str, name: str, optional: bool) -> Mapping[str, str] | None:
            data = self.node.api.read_object(kind, namespace, name)
            if data is None and not optional:
                raise NotYetAvailable("CreateContainerConfigError",
                                      f"{kind} {namespace!r}/{name!r} not found")
            return None if data is None else {k: v.decode() for k, v in data.items()}

        env = podspec.container_env(self.pod, container.spec, base=base, pod_ip=self._pod_ip,
                                    host_ip=self.node.address, lookup=lookup)
        sees_gpus = bool(container.gpus) or spec.get("runtimeClassName") == "nvidia"
        if container.gpus:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(map(str, container.gpus))
        if sees_gpus:
            env["TESSERA_SIM_GPU_STATE"] = str(self.node.gpu_state)
            env["TESSERA_SIM_DEVICES"] = str(self.node.device_dir)
            env[GENERATION_ENV] = self.node.dcgm_generation
        return env

    def _mounts(self, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
        assert self._volumes is not None
        mounts = []
        if not self.pod["spec"].get("hostNetwork"):
            # The kubelet's hosts file: the pod's host name resolves to its own address, which
            # is what a process binding by host name (Gloo, for one) then listens on.
            self.dir.mkdir(parents=True, exist_ok=True)
            hosts = self.dir / "etc-hosts"
            hosts.write_text("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"
                             f"::1\tlocalhost ip6-localhost ip6-loopback\n"
                             f"{self._pod_ip}\t{self._hostname()}\n")
            mounts.append({"source": str(hosts), "target": "/etc/hosts", "readOnly": True})
        for mount in spec.get("volumeMounts") or []:
            source = self._volumes.paths[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
                if not source.exists():
                    source.mkdir(parents=True)
            read_only = bool(mount.get("readOnly")) or mount["name"] in self._volumes.read_only
            mounts.append({"source": str(source), "target": mount["mountPath"],
                           "readOnly": read_only})
        return mounts

    # -- status

    @property
    def name(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    def _fail(self, reason: str, message: str) -> None:
        log.warning("pod %s failed: %s: %s", self.name, reason, message)
        self._event("Warning", reason, message)
        self._phase_reason = (reason, message)
        for container in self.containers:
            if "terminated" not in container.state:
                container.state = {"terminated": {"exitCode": 128, "reason": reason,
                                                  "message": message}}
            container.done = True
        self._best_effort(self._publish)

    def _phase(self) -> str:
        if self._phase_reason is not None:
            return "Failed"
        return podspec.phase(self._inits_done, self._init_failed,
                             (c.outcome() for c in self.apps))

    def _status(self) -> dict[str, Any]:
        phase = self._phase()
        ready = phase == "Running" and all(c.ready for c in self.apps)
        wanted = {"PodScheduled": True, "PodReadyToStartContainers": bool(self._pod_ip),
                  "Initialized": self._inits_done, "ContainersReady": ready, "Ready": ready}
        previous = (self.pod.get("status") or {}).get("conditions") or []
        waiting = self._waiting
        healthy = self.node.dra.healthy() if self.node.dra and any(
            c.claims for c in self.containers) else set()
        containers = []
        for container in self.apps:
            status = self._container_status(container, healthy)
            if waiting and "waiting" in container.state:
                status["state"] = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
            containers.append(status)
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": podspec.conditions(previous, wanted, now_rfc3339()),
            "hostIP": self.node.address, "hostIPs": [{"ip": self.node.address}],
            "startTime": self._start_time,
            "containerStatuses": containers,
            "initContainerStatuses": [self._container_status(c, healthy) for c in self.inits],
            "reason": None, "message": None,
        }
        if self._pod_ip:
            status["podIP"] = self._pod_ip
            status["podIPs"] = [{"ip": self._pod_ip}]
        if self._phase_reason is not None:
            status["reason"], status["message"] = self._phase_reason
        return status

    @staticmethod
    def _container_status(container: ContainerState, healthy: set[int]) -> dict[str, Any]:
        """The container's status, with the health of its claims' devices where it has any
        (as the kubelet reports them: the whole list, since containerStatuses merge whole)."""
        status = container.status()
        if container.claims:
            status["allocatedResourcesStatus"] = dra.resource_health(container.claims, healthy)
        return status

    def _publish(self) -> None:
        status = self._status()
        comparable = {k: v for k, v in status.items() if k != "conditions"} | {
            "conditions": [(c["type"], c["status"]) for c in status["conditions"]]}
        if comparable == self._sent:
            return
        meta = self.pod["metadata"]
        try:
            self.node.api.patch_pod_status(meta["namespace"], meta["name"], status)
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            if not isinstance(exc, ApiException) or exc.status != 404:
                # the API server may be restarting: the worker publishes again shortly
                log.warning("pod %s: status update failed: %s", self.name, exc)
                self._unpublished = True
                return
        self._sent = comparable
        self._unpublished = False

    def _event(self, kind: str, reason: str, message: str,
               container: str | None = None) -> None:
        self._best_effort(lambda: self.node.api.record_event(
            self.pod, self.node.name, kind, reason, message, container))

    def _best_effort(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception:  # the API server may be gone or the pod deleted meanwhile
            log.warning("pod %s: API call failed", self.name, exc_info=True)

    def _release(self) -> None:
        self.node.gpus.release(self.uid)
        if not self.pod["spec"].get("hostNetwork"):
            self.node.ips.release(self.uid)

    def _wait(self, timeout: float | None) -> None:
        self._wake.wait(timeout)
        self._wake.clear()
