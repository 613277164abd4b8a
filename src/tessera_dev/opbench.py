"""`tessera-dev bench operator`: the operator at cluster scale on a real control plane of its own.

It starts etcd, kube-apiserver, the controller-manager and the scheduler on loopback, applies the
CRDs and the shipped RBAC and admission policies, registers `--nodes` simulated 8-GPU Node objects
(no node processes) and runs the operator as a subprocess under its own service account. The
controller-manager runs without its node lifecycle controller: the registered nodes stay Ready as
heartbeating nodes do, rather than all going NotReady at once (a storm of node and pod updates,
and after 300 s the eviction of every pod on them, which no healthy cluster sees). Then:

1. `--jobs` NTP-PW jobs, each of a distinct model shape, share the nodes; all reach Running
   (the time from the first creation, and the CPU seconds the operator and each control-plane
   server spent in it). The operator then works off the watch events of that creation (its own
   target writes, the pods' scheduling); the bench waits until its CPU use falls, and prints how
   long that took.
2. `--cordons` GPUs cordoned one at a time, each on a different job: cordon-to-status latency
   (from the node patch to the job's status showing the reduced replica, seen on a watch),
   p50 and p99 against the 1 s target; the apiserver requests and the operator's CPU each
   change costs.
3. The operator's resident memory (VmRSS) after start, with every job Running, after the
   cordons, and after one more job at the schema's largest model shape is degraded, against the
   Deployment's 512 Mi limit.
4. Steady state: the apiserver's own `apiserver_request_total` over `--window` seconds with
   nothing changing, against the same window once the operator has stopped (the
   controller-manager and scheduler alone): the operator's share, per node, extrapolated to the
   paper's 8,192 nodes. Renewal traffic that grew with time x nodes would show here. The resync
   timer (`RESYNC_READS` per job every 5 minutes) is added from its definition, since a window
   rarely holds one.

The exit status is 1 when p99 misses the target or memory reaches half the limit.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tessera_contracts.api import CORDON_ANNOTATION
from tessera_dev import paths, probes, processes, simnodes
from tessera_dev.controlplane import crds, launcher, manifests
from tessera_kube.listwatch import ListWatch
from tessera_operator.handlers import GROUP, PLURAL, VERSION
from tessera_operator.reconcile import RESYNC_INTERVAL_S

P99_TARGET_S = 1.0
MEMORY_LIMIT_MIB = 512  # manifests/operator/deployment.yaml
PAPER_NODES = 8192
# A reconcile that finds nothing changed: the job, its pods, layout and progress, and its targets
# (listed once, for planning and the sync); its nodes come from the node watch.
RESYNC_READS = 5
# How long the operator may take to work off the watch events of the jobs' creation.
IDLE_TIMEOUT_S = 600.0
GPUS_PER_NODE = 8
SYSTEM_NS, OPERATOR_SA = "tessera-system", "tessera-operator"
# The shipped identities, RBAC and admission; not the workloads (no kubelet would run them).
MANIFESTS = ("manifests/system/namespace.yaml", "manifests/power-controller/rbac.yaml",
             "manifests/power-controller/admission.yaml", "manifests/operator/rbac.yaml",
             "manifests/operator/admission.yaml")
NAMESPACE = "bench"
# The schema's largest model (the NTPTrainingJob CRD), run at TP 8 on one node.
LARGEST_MODEL = {"hidden": 262144, "heads": 4096, "kvHeads": 4096, "ffn": 1048576,
                 "vocab": 4194304, "layers": 4096, "seqLen": 16777216}
_REQUESTS = re.compile(r'^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# What the operator may request (its RBAC), less Events: it posts those only for decisions,
# while the control plane posts its own (the scheduler's), which would land in either window.
OPERATOR_KINDS = re.compile(
    r"^(GET|LIST|PATCH|APPLY|PUT|POST|DELETE) (ntptrainingjobs(/status)?|configmaps|"
    r"gpupowertargets(/status)?)$|^(GET|LIST) nodes$")


@dataclass(frozen=True)
class Figures:
    nodes: int
    jobs: int
    idle: Counter[str]  # apiserver requests/s per kind once the operator stopped
    steady: Counter[str]  # the same with the operator running, nothing changing
    latencies_s: tuple[float, ...]
    requests_per_cordon: float
    cpu_per_cordon_s: float  # the operator's CPU seconds from a cordon to the status that shows it
    rss_mib: dict[str, float]
    backlog_s: float  # from every job Running to the operator idle
    creation_s: float  # from the first job created to every job Running
    creation_cpu_s: dict[str, float]  # CPU seconds of each process in that time

    @property
    def operator(self) -> Counter[str]:
        """What the operator adds, kind by kind, over the kinds it requests (the rest of the
        control plane is in both windows)."""
        return Counter({k: v for k, v in (self.steady - self.idle).items()
                        if OPERATOR_KINDS.match(k)})

    @property
    def operator_rps(self) -> float:
        return sum(self.operator.values())

    def p(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _job(name: str, nodes: int, model: dict[str, int]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "NTPTrainingJob", "metadata": {"name": name},
        "spec": {
            "image": "tessera:bench", "model": model, "tensorParallelSize": 8,
            "template": {"spec": {"nodeSelector": simnodes.pool_selector(name)}},
            "dataParallelReplicas": nodes, "totalGPUs": nodes * GPUS_PER_NODE,
            "failurePolicy": {"mode": "NTP-PW", "minTensorParallelSize": 4},
            "powerPolicy": {"baseCapWatts": 600, "boostCapWatts": 700,
                            "rackBudgetWatts": 4800},
        },
    }


def _shape(i: int) -> dict[str, int]:
    """A distinct Llama-8B-like shape per job (FFN and vocabulary vary)."""
    return {"hidden": 4096, "heads": 32, "kvHeads": 8, "ffn": 14336 + 64 * i,
            "vocab": 128256 + 8 * i, "layers": 32, "seqLen": 8192}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _requests(api: client.ApiClient) -> Counter[str]:
    """Requests the apiserver has answered so far by its own counter, per "VERB resource"
    (watches excluded: one long request each, counted when it ends)."""
    response = api.call_api("GET", f"{api.configuration.host}/metrics", _request_timeout=30)
    response.read()
    counts: Counter[str] = Counter()
    for labels, value in _REQUESTS.findall(response.data.decode()):
        label = dict(_LABEL.findall(labels))
        if label.get("verb") != "WATCH":
            kind = "/".join(p for p in (label.get("resource"), label.get("subresource")) if p)
            counts[f"{label.get('verb')} {kind or '-'}"] += float(value)
    return counts


def _rate(api: client.ApiClient, window_s: float) -> Counter[str]:
    """Requests/s per "VERB resource" over a window (each window holds one /metrics read of
    ours, so two windows compare like for like)."""
    before, t0 = _requests(api), time.monotonic()
    time.sleep(window_s)  # the measurement window itself, not a synchronization
    after, elapsed = _requests(api), time.monotonic() - t0
    return Counter({k: n / elapsed for k, n in (after - before).items()})


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_idle(pid: int, timeout_s: float) -> float:
    """Until the operator has worked off the watch events queued so far (it used under 5% of a
    core over the last two seconds); returns how long that took. A thousand targets and node
    updates take it tens of seconds on a loaded machine, and a cordon queued behind them would
    measure the backlog, not the reaction."""
    start = time.monotonic()
    samples = [(start, _cpu_s(pid))]

    def busy() -> float:
        samples.append((time.monotonic(), _cpu_s(pid)))
        while samples[-1][0] - samples[1][0] >= 2.0:
            samples.pop(0)
        (t0, c0), (t1, c1) = samples[0], samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 - t0 >= 2.0 else 1.0

    probes.poll_until(busy, lambda load: load < 0.05, timeout=timeout_s, interval=0.25,
                      error=lambda load: TimeoutError(f"the operator stays busy ({load:.0%})"))
    return time.monotonic() - start


class JobWatch:
    """The jobs' statuses as a watch delivers them, and a wait for a condition on one job."""

    def __init__(self, api: client.ApiClient) -> None:
        self._custom = client.CustomObjectsApi(api)
        self._status: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, float] = {}
        self._changed = threading.Condition()
        self._watch = ListWatch(
            self._custom.list_namespaced_custom_object, GROUP, VERSION, NAMESPACE, PLURAL,
            on_list=self._listed, on_event=self._event, on_error=lambda _: None, watch_s=300,
            name="job watch").start()

    def _listed(self, jobs: list[dict[str, Any]]) -> None:
        for job in jobs:
            self._event("ADDED", job)

    def _event(self, _: str, job: dict[str, Any]) -> None:
        with self._changed:
            name = job["metadata"]["name"]
            self._status[name] = job.get("status") or {}
            self._seen[name] = time.monotonic()
            self._changed.notify_all()

    def wait(self, name: str, done: Any, timeout_s: float) -> float:
        """Block until `done(status)` holds for job `name`; returns when the watch saw it."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not done(self._status.get(name, {})):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job {name}: last status {self._status.get(name)!r}")
                self._changed.wait(left)
            return self._seen[name]

    def stop(self) -> None:
        self._watch.stop()


@contextmanager
def _operator(plane: launcher.ControlPlane, work: Path) -> Iterator[subprocess.Popen]:
    token = plane.service_account_token(SYSTEM_NS, OPERATOR_SA)
    kubeconfig = work / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(plane.token_kubeconfig(
        token, f"system:serviceaccount:{SYSTEM_NS}:{OPERATOR_SA}")))
    log = work / "operator.log"
    health = f"http://127.0.0.1:{processes.free_ports(1)[0]}/healthz"
    proc = processes.spawn([sys.executable, "-m", "tessera_operator.run", "--kubeconfig",
                            str(kubeconfig), "--namespace", NAMESPACE, "--liveness", health],
                           log, die_with_parent=True)
    try:
        # Started means serving its liveness probe: kopf is up and watching.
        processes.wait_until(lambda: probes.responds(health), what="the operator", proc=proc,
                             log_path=log, timeout=120)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            processes.stop_group(proc)


def create_nodes(api: client.ApiClient, groups: dict[str, list[str]]) -> None:
    """Each job's nodes in a pool of its own, which its nodeSelector names."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: simnodes.register(api, [item[1]], item[0], GPUS_PER_NODE),
                      [(job, n) for job, nodes in groups.items() for n in nodes]))


def run(nodes: int, jobs: int, cordons: int, window_s: float, timeout_s: float,
        log: Any = print) -> Figures:
    per_job = nodes // jobs
    groups = {f"job-{j:04d}": [f"node-{j:04d}-{k:02d}" for k in range(per_job)]
              for j in range(jobs)}
    with tempfile.TemporaryDirectory(prefix="tessera-opbench-") as tmp, \
            launcher.ControlPlane.start(bin_dir=launcher.binaries(log=log),
                                        node_lifecycle=False) as plane, \
            plane.api_client() as api:
        work = Path(tmp)
        crds.apply(api, crds.load())
        manifests.apply(api, [paths.repo_root() / m for m in MANIFESTS])
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
        create_nodes(api, groups)
        log(f"{nodes} nodes registered")
        custom = client.CustomObjectsApi(api)
        jobs_watch = JobWatch(api)
        rss: dict[str, float] = {}
        try:
            with _operator(plane, work) as proc:
                rss["started"] = rss_mib(proc.pid)
                log("operator started")
                pids = {"operator": proc.pid} | {
                    name: plane.pids[name] for name in launcher.SERVERS}
                created, cpu_before = time.monotonic(), {n: _cpu_s(p) for n, p in pids.items()}
                for i, job in enumerate(groups):
                    custom.create_namespaced_custom_object(
                        GROUP, VERSION, NAMESPACE, PLURAL, _job(job, per_job, _shape(i)))
                healthy = ",".join(["8"] * per_job)
                for job in groups:
                    jobs_watch.wait(job, lambda s: s.get("tpLayout") == healthy, timeout_s)
                creation_s = time.monotonic() - created
                creation_cpu = {n: _cpu_s(p) - cpu_before[n] for n, p in pids.items()}
                rss["jobs running"] = rss_mib(proc.pid)
                log(f"{jobs} jobs Running")
                backlog_s = wait_idle(proc.pid, max(timeout_s, IDLE_TIMEOUT_S))
                log(f"operator idle after {backlog_s:.1f} s more; cordoning {cordons} GPUs")
                latencies, before = [], sum(_requests(api).values())
                cpu_before = _cpu_s(proc.pid)
                for job in list(groups)[:cordons]:
                    node = groups[job][0]
                    t0 = time.monotonic()
                    client.CoreV1Api(api).patch_node(
                        node, {"metadata": {"annotations": {CORDON_ANNOTATION: "3"}}})
                    seen = jobs_watch.wait(job, lambda s: "7" in s.get("tpLayout", "").split(
                        ","), timeout_s)
                    latencies.append(seen - t0)
                per_cordon = (sum(_requests(api).values()) - before) / cordons
                cpu_per_cordon = (_cpu_s(proc.pid) - cpu_before) / cordons
                rss["after cordons"] = rss_mib(proc.pid)
                _largest(api, jobs_watch, timeout_s)
                rss["largest shape degraded"] = rss_mib(proc.pid)
                log("largest-shape job degraded")
                wait_idle(proc.pid, max(timeout_s, IDLE_TIMEOUT_S))
                log(f"measuring steady state for {window_s:.0f} s")
                steady = _rate(api, window_s)
                if not processes.is_alive(proc):
                    raise RuntimeError("the operator exited:\n" + processes.log_tail(
                        work / "operator.log", 40))
            # The same window without the operator, the cluster otherwise as it was.
            log(f"operator stopped; measuring the control plane alone for {window_s:.0f} s")
            idle = _rate(api, window_s)
        finally:
            jobs_watch.stop()
    return Figures(per_job * jobs, jobs, idle, steady, tuple(latencies), per_cordon,
                   cpu_per_cordon, rss, backlog_s, creation_s, creation_cpu)


def _largest(api: client.ApiClient, jobs_watch: JobWatch, timeout_s: float) -> None:
    name = "largest-shape"
    node = "node-largest"
    simnodes.register(api, [node], name, GPUS_PER_NODE)
    client.CoreV1Api(api).patch_node(
        node, {"metadata": {"annotations": {CORDON_ANNOTATION: "3"}}})
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, _job(name, 1, LARGEST_MODEL))
    jobs_watch.wait(name, lambda s: s.get("tpLayout") == "7", timeout_s)


def report(f: Figures) -> tuple[list[str], bool]:
    """The figures as printed lines, and whether the targets hold."""
    p50, p99 = f.p(0.5), f.p(0.99)
    per_node = f.operator_rps / f.nodes
    peak = max(f.rss_mib.values())
    lines = [
        f"cluster: {f.nodes} nodes x {GPUS_PER_NODE} GPUs, {f.jobs} NTP-PW jobs of distinct "
        f"shapes ({f.nodes // f.jobs} nodes each)",
        f"creation -> every job Running: {f.creation_s:.1f} s; CPU seconds in that time (of "
        f"{f.creation_s * (os.cpu_count() or 1):.0f} the machine had): "
        + ", ".join(f"{n} {c:.1f}" for n, c in f.creation_cpu_s.items()),
        f"operator idle {f.backlog_s:.1f} s after every job showed Running (the watch events "
        "of the jobs' creation worked off)",
        f"cordon -> status, {len(f.latencies_s)} cordons: p50 {p50 * 1000:.0f} ms, "
        f"p99 {p99 * 1000:.0f} ms (target < {P99_TARGET_S * 1000:.0f} ms: "
        f"p99 at {p99 / P99_TARGET_S:.2f} of it)",
        f"apiserver requests/s, nothing changing: {sum(f.steady.values()):.2f} with the "
        f"operator, {sum(f.idle.values()):.2f} without (same run); what it adds over the kinds "
        f"it requests: {f.operator_rps:.3f}/s ("
        + (", ".join(f"{k} {v:.3f}" for k, v in f.operator.most_common(3)) or "none") + ")",
        f"  per node {per_node:.5f}/s -> {per_node * PAPER_NODES:.2f}/s at {PAPER_NODES} nodes",
        f"  plus the resync timer, per job not per node: {RESYNC_READS} reads per job every "
        f"{RESYNC_INTERVAL_S:.0f} s = {RESYNC_READS * f.jobs / RESYNC_INTERVAL_S:.2f}/s for "
        f"{f.jobs} jobs",
        f"apiserver requests per cordon (the change, re-plan, status, targets): "
        f"{f.requests_per_cordon:.1f}; operator CPU per cordon: "
        f"{f.cpu_per_cordon_s * 1000:.0f} ms",
        "operator RSS (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in f.rss_mib.items())
        + f"; peak {peak / MEMORY_LIMIT_MIB:.2f} of the {MEMORY_LIMIT_MIB} Mi limit",
    ]
    return lines, p99 < P99_TARGET_S and peak < MEMORY_LIMIT_MIB / 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-dev bench operator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000, help="simulated 8-GPU nodes")
    parser.add_argument("--jobs", type=int, default=100, help="jobs sharing the nodes evenly")
    parser.add_argument("--cordons", type=int, default=50, help="GPUs cordoned, one per job")
    parser.add_argument("--window", type=float, default=30.0,
                        help="seconds of each request-rate measurement")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds any one job may take to reach a state before the bench "
                             "gives up")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not 1 <= args.jobs <= args.nodes:
        parser.error(f"--jobs must be between 1 and --nodes ({args.nodes}), got {args.jobs}")
    if not 1 <= args.cordons <= args.jobs:
        parser.error(f"--cordons must be between 1 and --jobs ({args.jobs}), got {args.cordons}")
    if not 0 < args.window <= 3600 or not 0 < args.timeout <= 3600:
        parser.error("--window and --timeout must be in (0, 3600] seconds")
    start = time.monotonic()
    figures = run(args.nodes, args.jobs, args.cordons, args.window, args.timeout,
                  log=lambda m: print(f"[{time.monotonic() - start:6.1f} s] {m}", file=sys.stderr))
    lines, ok = report(figures)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
