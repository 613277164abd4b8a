"""`tessera-dev bench recovery`: every failure policy on the same job and the same faults.

A local cluster of its own per policy (simulated nodes of 3 GPUs, Tessera installed from
manifests/local; fresh for each, so no policy meets a node another one froze) runs one job shape
(the example's model, TP3 x DP2 on two nodes, checkpointing every `--interval` steps on shared
storage) once per policy: NTP, NTP-PW, DROP, SPARE and CKPT-RESTART, with the product's timeouts
(heartbeat, rendezvous, restart) as shipped. SPARE and CKPT-RESTART get a third node, the spare
their policies restart or stand in on; NTP, NTP-PW and DROP run on the job's two nodes alone:
with a spare whole group at hand the planner packs it in place of the hit one, and NTP's
reshard would never be measured. Without it a GPU lost or cordoned leaves its replica training
at TP2 on the group's two survivors, and units move between TP ranks: the survivors rebalance
the split among themselves and take the lost rank's units from its DP peer
(`tessera_core.plan.reshard_moves`).

Into each run it injects one scripted sequence, each fault once the job trains settled on the
layout the operator published in answer to the one before: a GPU of the layout falls off the bus
(XID 79), that GPU comes back, a GPU of the layout is cordoned, the cordon is lifted, a node of
the layout freezes whole (its node process and every process of its pods SIGSTOPped; the node
holding the job's rendezvous is never the one). Each fault meets the job whole.

It reads what the job did from its trainer pods' logs (each step's end time, samples and
layout; the node agents' notices of a failure) and every layout document the operator
published (each replica's GPUs, from a watch: a drop and a spare's join can follow each other
within a second), and reports, per policy and fault, detection, every switch of layout the
fault caused with what it did and its pause, the layouts the job went through, the time it
trained at reduced capacity and the steps redone (`tessera_dev.recovery_figures`); per policy the
throughput while degraded against healthy, goodput in time and step form, and energy per sample
from the simulated GPUs' energy counters; and, per failure, the training time NTP lost (pauses
and steps redone) against checkpoint-restart's. A table on stdout; `recovery.json`
(`tessera.recovery/v2`, what `tessera-dev simulate --pauses` reads) and `recovery.png` (steps
over time per policy, faults marked) in `--out`. The machine's load average is printed beside
each run: on two shared cores every figure includes the contention of the control plane, the
nodes and the ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client, watch

from tessera_agents.power.sim_backend import SimBackend
from tessera_cli import cordon
from tessera_contracts.api import (
    ATTEMPT_LABEL,
    GPU_HEALTH_PLURAL,
    GROUP,
    JOB_LABEL,
    JOB_PLURAL,
    ROLE_LABEL,
    VERSION,
)
from tessera_contracts.generation import LAYOUT_KEY, Generation, Gpu, layout_configmap
from tessera_contracts.gpuhealth import STATE_NAMES, State
from tessera_contracts.model_shape import ModelShape
from tessera_contracts.rank_events import RecordError, StepRecord, parse_line
from tessera_dev import demo_data, install, paths, probes
from tessera_dev.controlplane import cluster, launcher
from tessera_dev.demo import EXAMPLE
from tessera_dev.recovery_figures import (
    Fault,
    FaultFigures,
    FiguresError,
    Replicas,
    RunFigures,
    Step,
    fault_figures,
    recovered,
    run_figures,
    step_time,
)
from tessera_dev.simnode import faults
from tessera_sim.pauses import FAILURE_KINDS, FORMAT

GPUS, TP, DP = 3, 3, 2
JOB_NODES = TP * DP // GPUS
# The job's failure policy -> the simulator's name for it (tessera_sim.policies).
POLICIES = {"NTP": "ntp", "NTP-PW": "ntp-pw", "DROP": "dp-drop", "SPARE": "spares",
            "CKPT-RESTART": "ckpt-restart"}
# The policies that take a spare node: SPARE stands it in for a hit group, CKPT-RESTART
# restarts on it. NTP and NTP-PW keep the hit group at a lower TP degree (given a spare they
# would take its whole group instead); DROP keeps to its own groups.
SPARES = frozenset({"SPARE", "CKPT-RESTART"})
SEQUENCE = ("gpu-lost", "gpu-returned", "gpu-cordoned", "gpu-uncordoned", "node-lost")
# A fault that takes back the one before it in the sequence.
UNDOES = {"gpu-returned": "gpu-lost", "gpu-uncordoned": "gpu-cordoned"}
DETECTED = frozenset({"gpu-lost", "node-lost"})  # the others the job is told of
# A node agent's notice that a generation failed (`%(asctime)s` first, this host's local time).
NOTICE = re.compile(r"generation \d+ (ended: )?failed")
# Guards against a hang, not bounds on how fast anything recovers.
HANG_S = 300.0


def nodes(policy: str) -> int:
    """The nodes of `policy`'s cluster and job: the job's, and a spare where it takes one."""
    return JOB_NODES + (policy in SPARES)


def job_manifest(policy: str, claim: str, interval: int) -> dict[str, Any]:
    """The example job on this cluster: TP3 x DP2 on `nodes(policy)` nodes, checkpoints on
    `claim`."""
    job = demo_data.without_dataset(yaml.safe_load(EXAMPLE.read_text()))
    job["metadata"] = {"name": "bench"}
    spec = job["spec"]
    spec |= {"tensorParallelSize": TP, "dataParallelReplicas": DP, "gpusPerNode": GPUS,
             "totalGPUs": nodes(policy) * GPUS, "steps": 10_000_000,
             "checkpointPolicy": {"path": "/checkpoints/run", "intervalSteps": interval}}
    spec["failurePolicy"] = {"mode": policy, "minTensorParallelSize": 1}
    if policy == "NTP-PW":
        spec["powerPolicy"]["rackBudgetWatts"] = GPUS * spec["powerPolicy"]["baseCapWatts"] + 200
    else:
        del spec["powerPolicy"]
    pod = spec["template"]["spec"]
    pod["volumes"] = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}}]
    pod["containers"][0]["volumeMounts"] = [{"name": "checkpoints", "mountPath": "/checkpoints"}]
    return job


@dataclass
class Watch:
    """What the job's trainer pods log: steps (one per layout and step) and failure notices;
    every layout the operator publishes, (attempt, generation) -> its replicas; and the one it
    publishes now, with when it was first seen."""

    api: client.ApiClient
    namespace: str
    job: str
    steps: dict[tuple[int, int, int], Step] = field(default_factory=dict)
    notices: list[float] = field(default_factory=list)
    layouts: dict[tuple[int, int], Replicas] = field(default_factory=dict)
    published: tuple[int, int] | None = None
    since: float = 0.0
    changed: threading.Condition = field(default_factory=threading.Condition)
    stopped: threading.Event = field(default_factory=threading.Event)
    _followed: set[str] = field(default_factory=set)  # pod uids

    def start(self) -> None:
        threading.Thread(target=self._pods, daemon=True).start()
        threading.Thread(target=self._layouts, daemon=True).start()

    def _layouts(self) -> None:
        """Every version of the layout ConfigMap, as a watch delivers it; a watch that breaks
        is started afresh (its first events are the ConfigMap as it is)."""
        core = client.CoreV1Api(self.api)
        selector = f"metadata.name={layout_configmap(self.job)}"
        while not self.stopped.is_set():
            try:
                for event in watch.Watch().stream(core.list_namespaced_config_map,
                                                  self.namespace, field_selector=selector,
                                                  timeout_seconds=30, _request_timeout=60):
                    if self.stopped.is_set():
                        return
                    try:
                        found = None if event["type"] == "DELETED" else layout_of(event["object"])
                    except ValueError:
                        continue  # no generation: nothing the ranks could train on either
                    self._publish(found)
            except (client.ApiException, OSError, ValueError, urllib3.exceptions.HTTPError):
                self.stopped.wait(0.5)  # the next watch

    def _publish(self, found: tuple[int, Generation] | None) -> None:
        key = None if found is None else (found[0], found[1].generation)
        with self.changed:
            if found is not None:
                self.layouts.setdefault(key, tuple(tuple(str(g) for g in replica)
                                                   for replica in found[1].replicas))
            if key != self.published:
                self.published, self.since = key, time.time()
                self.changed.notify_all()

    def _pods(self) -> None:
        core = client.CoreV1Api(self.api)
        while not self.stopped.wait(0.5):
            try:
                pods = core.list_namespaced_pod(
                    self.namespace, label_selector=f"{JOB_LABEL}={self.job},{ROLE_LABEL}=trainer",
                    _request_timeout=10).items
            except (client.ApiException, OSError):
                continue  # the next look
            for pod in pods:
                # By uid: a restarted attempt's pods take the names of the attempt before.
                if pod.metadata.uid in self._followed or pod.status.phase != "Running":
                    continue
                self._followed.add(pod.metadata.uid)
                attempt = int(pod.metadata.labels.get(ATTEMPT_LABEL, "0"))
                threading.Thread(target=self._follow, args=(pod.metadata.name, attempt),
                                 daemon=True).start()

    def _follow(self, pod: str, attempt: int) -> None:
        try:
            stream = client.CoreV1Api(self.api).read_namespaced_pod_log(
                pod, self.namespace, container="trainer", follow=True, _preload_content=False)
            for raw in stream:
                self._line(raw.decode(errors="replace").rstrip("\n"), attempt)
        except (client.ApiException, OSError, ValueError):
            return  # the pod went; what it logged is in

    def _line(self, line: str, attempt: int) -> None:
        if NOTICE.search(line):
            try:
                at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                return
            with self.changed:
                self.notices.append(at)
                self.changed.notify_all()
            return
        try:
            record = parse_line(line)
        except RecordError:
            return
        if not isinstance(record, StepRecord) or record.time is None:
            return
        key = (attempt, record.generation, record.step)
        with self.changed:
            if key not in self.steps:
                self.steps[key] = Step(record.time, record.step, record.samples,
                                       (attempt, record.generation), record.tp_degrees)
                self.changed.notify_all()

    def snapshot(self) -> tuple[list[Step], dict[tuple[int, int], Replicas]]:
        with self.changed:
            return sorted(self.steps.values(), key=lambda s: s.time), dict(self.layouts)

    def until(self, what: str, done: Callable[[list[Step]], bool]) -> list[Step]:
        deadline = time.monotonic() + HANG_S
        with self.changed:
            while True:
                steps = sorted(self.steps.values(), key=lambda s: s.time)
                if done(steps):
                    return steps
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} not seen in {HANG_S:.0f} s; last step "
                                       f"{steps[-1] if steps else None}")
                self.changed.wait(min(left, 1.0))

    def first_notice(self, after: float) -> float | None:
        with self.changed:
            return min((t for t in self.notices if t > after), default=None)


def energy_mj(data_dir: Path, names: list[str]) -> float:
    """The simulated GPUs' energy counters of nodes `names`, summed (mJ)."""
    total = 0.0
    for name in names:
        state = faults.node_dir(data_dir, name) / faults.GPU_STATE
        total += sum(g.energy_mj for g in SimBackend(state_path=state).snapshot())
    return total


def published_layout(core: client.CoreV1Api, namespace: str, job: str
                     ) -> tuple[int, Generation] | None:
    """The attempt and generation the job's layout ConfigMap holds; None while it holds none
    (between CKPT-RESTART's attempts the operator has not published the next one yet)."""
    try:
        cm = core.read_namespaced_config_map(layout_configmap(job), namespace,
                                             _request_timeout=10)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return layout_of(cm)


def layout_of(cm: client.V1ConfigMap) -> tuple[int, Generation] | None:
    """The attempt and generation a layout ConfigMap holds; None when it holds none. ValueError
    for a document that is no generation."""
    data = cm.data or {}
    if LAYOUT_KEY not in data:
        return None
    attempt = int((cm.metadata.labels or {}).get(ATTEMPT_LABEL, "0"))
    return attempt, Generation.from_dict(json.loads(data[LAYOUT_KEY]))


def layout(api: client.ApiClient, namespace: str, job: str) -> Generation:
    """The generation in force; waited for while there is none."""
    core = client.CoreV1Api(api)
    found = probes.poll_until(lambda: published_layout(core, namespace, job), timeout=HANG_S,
                              interval=0.5, error=lambda _: TimeoutError(
                                  f"no layout published for {namespace}/{job} in {HANG_S:.0f} s"))
    assert found is not None
    return found[1]


@dataclass
class Run:
    """One policy's run on the cluster: the job, its watch and the faults injected."""

    plane: launcher.ControlPlane
    running: cluster.Cluster
    api: client.ApiClient
    policy: str
    interval: int
    settle: int
    namespace: str = field(default_factory=lambda: f"recovery-{uuid.uuid4().hex[:6]}")
    faults: list[Fault] = field(default_factory=list)
    lost: Gpu | None = None
    cordoned: Gpu | None = None
    frozen: str | None = None

    def _fault_args(self, *argv: str) -> list[str]:
        return [*argv, "--data-dir", str(self.plane.data_dir)]

    def inject(self, kind: str) -> float:
        """Inject `kind`; the time from which the job's health sources can tell it (a GPU
        back from XID 79 reads as failed in its GPUHealth for a while after it returns)."""
        current = layout(self.api, self.namespace, "bench")
        ready = None
        if kind == "gpu-lost":
            self.lost = current.replicas[0][-1]
            at = time.time()
            _check(faults.fail_gpu(self._fault_args(self.lost.node, str(self.lost.index))))
        elif kind == "gpu-returned":
            assert self.lost is not None, "a GPU returns after one was lost"
            # A GPU off the bus is repaired long after DCGM names it: not before DCGM saw it
            # (the job would read one it never saw fail as a rank's death on a healthy GPU).
            self._reads(self.lost, State.FAILED)
            at = time.time()
            _check(faults.restore_gpu(self._fault_args(self.lost.node, str(self.lost.index))))
            ready = self._reads(self.lost, State.HEALTHY)
            self.lost = None
        elif kind == "gpu-cordoned":
            self.cordoned = next(g for g in reversed(current.gpus) if g != self.lost)
            at = time.time()
            _check(cordon.main([self.cordoned.node, str(self.cordoned.index),
                                "--kubeconfig", str(self.plane.kubeconfig)]))
        elif kind == "gpu-uncordoned":
            assert self.cordoned is not None, "a cordon is lifted after one was set"
            at = time.time()
            _check(cordon.run([self.cordoned.node, str(self.cordoned.index), "--kubeconfig",
                               str(self.plane.kubeconfig)], cordon=False))
            self.cordoned = None
        else:
            self.frozen = self._freezable(current)
            at = time.time()
            _check(faults.fail_node(self._fault_args(self.frozen, "--freeze")))
        self.faults.append(Fault(kind, at, None))
        return ready or at

    def _reads(self, gpu: Gpu, wanted: State) -> float:
        """When `gpu`'s GPUHealth first reads it `wanted`."""
        objects = client.CustomObjectsApi(self.api)

        def state() -> str | None:
            found = objects.get_cluster_custom_object(GROUP, VERSION, GPU_HEALTH_PLURAL, gpu.node)
            return next((g.get("state") for g in (found.get("status") or {}).get("gpus") or []
                         if g.get("index") == gpu.index), None)

        name = STATE_NAMES[wanted]
        probes.poll_until(state, lambda s: s == name, timeout=HANG_S, interval=0.5,
                          error=lambda s: TimeoutError(f"{gpu} not {name} in its GPUHealth in "
                                                       f"{HANG_S:.0f} s (state {s})"))
        return time.time()

    def _freezable(self, current: Generation) -> str:
        """A node of the layout without the job's rendezvous, and with the operator's leader
        moved off it (on a real cluster neither shares a GPU node)."""
        pods = client.CoreV1Api(self.api).list_namespaced_pod(
            self.namespace, label_selector=f"{JOB_LABEL}=bench,{ROLE_LABEL}=rendezvous").items
        rendezvous = {p.spec.node_name for p in pods}
        candidates = [n for n in dict.fromkeys(g.node for g in current.gpus)
                      if n not in rendezvous]
        if not candidates:
            raise RuntimeError(f"every node of the layout holds the rendezvous: {rendezvous}")
        free = [n for n in candidates if n != install.leader_node(self.api)]
        if free:
            return free[0]
        install.leader_off(self.api, candidates[0], HANG_S)
        return candidates[0]

    def undo(self) -> None:
        """Every fault still in force taken back: the node thawed, the cordon lifted, the GPU
        restored."""
        if self.frozen is not None:
            faults.fail_node(self._fault_args(self.frozen, "--thaw"))
        if self.cordoned is not None:
            cordon.run([self.cordoned.node, str(self.cordoned.index), "--kubeconfig",
                        str(self.plane.kubeconfig)], cordon=False)
        if self.lost is not None:
            faults.restore_gpu(self._fault_args(self.lost.node, str(self.lost.index)))

    @contextmanager
    def job(self) -> Iterator[Watch]:
        core = client.CoreV1Api(self.api)
        core.create_namespace({"metadata": {"name": self.namespace}})
        try:
            probes.poll_until(lambda: core.list_namespaced_service_account(
                self.namespace, field_selector="metadata.name=default").items, timeout=60,
                error=lambda _: TimeoutError(f"no default service account in {self.namespace}"))
            claim = self.running.shared_volume(self.api, "checkpoints", self.namespace, "1Gi")
            client.CustomObjectsApi(self.api).create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, JOB_PLURAL,
                job_manifest(self.policy, claim, self.interval))
            watch = Watch(self.api, self.namespace, "bench")
            watch.start()
            try:
                yield watch
            finally:
                watch.stopped.set()
                self.undo()
        finally:
            core.delete_namespace(self.namespace)
            probes.poll_until(lambda: core.list_namespaced_pod(self.namespace).items,
                              lambda pods: not pods, timeout=HANG_S, interval=0.5,
                              error=lambda last: TimeoutError(f"pods of {self.namespace} left"))

    def situation(self) -> str:
        """The job's phase, its Ready condition and those true, for a run that stalled."""
        status = self.status()
        true = [f"{c.get('type')} {c.get('status')} ({c.get('reason')}: {c.get('message')})"
                for c in status.get("conditions", [])
                if c.get("status") == "True" or c.get("type") == "Ready"]
        return (f"phase {status.get('phase')}, attempt {status.get('attempt', 0)}; "
                f"{'; '.join(true) or 'no condition true'}")

    def status(self) -> dict[str, Any]:
        job = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, JOB_PLURAL, "bench")
        return job.get("status") or {}


def _check(code: int) -> None:
    if code != 0:
        raise RuntimeError(f"a fault could not be injected (exit {code})")


@dataclass
class Result:
    policy: str
    steps: list[Step]
    layouts: dict[tuple[int, int], Replicas]
    faults: list[Fault]
    figures: list[FaultFigures]
    run: RunFigures
    status_goodput: float | None
    load: tuple[float, float]  # 1-minute load average before and after


def bench_policy(plane: launcher.ControlPlane, running: cluster.Cluster, api: client.ApiClient,
                 policy: str, sequence: tuple[str, ...], interval: int, warmup: int,
                 settle: int) -> Result:
    load_before = os.getloadavg()[0]
    run = Run(plane, running, api, policy, interval, settle)
    names = list(running.nodes)
    with run.job() as watch:
        watch.until("the job's first steps", lambda s: len(s) >= warmup + settle)
        start_mj, start_at = energy_mj(plane.data_dir, names), time.time()
        for kind in sequence:
            ready = run.inject(kind)
            try:
                after = watch.until(
                    f"training after the {kind}", lambda steps, ready=ready: recovered(
                        steps, ready, settle, watch.published, watch.since))
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; the job then: {run.situation()}") from exc
            print(f"  {kind}: training at step {after[-1].step} on (attempt, generation) "
                  f"{after[-1].layout}, {after[-1].time - run.faults[-1].at:.1f} s after it",
                  flush=True)
        stop_at = time.time()
        run.undo()
        run.frozen = run.cordoned = None
        energy_j = (energy_mj(plane.data_dir, names) - start_mj) / 1e3
        status = run.status()
        steps, layouts = watch.snapshot()
    noticed = [Fault(f.kind, f.at, watch.first_notice(f.at) if f.kind in DETECTED else None)
               for f in run.faults]
    ends = [f.at for f in noticed[1:]] + [stop_at]
    figures = [fault_figures(steps, f, layouts, TP * DP, until)
               for f, until in zip(noticed, ends, strict=True)]
    inside = [s for s in steps if s.time <= stop_at]
    figures_run = run_figures(inside, noticed, figures, warmup, energy_j, start_at)
    return Result(policy, steps, layouts, noticed, figures, figures_run, status.get("goodput"),
                  (load_before, os.getloadavg()[0]))


def document(results: list[Result], interval: int, warmup: int) -> dict[str, Any]:
    """The bench's file: `tessera.recovery/v2` (tessera_sim.pauses) with each run's figures and
    the layouts it trained on."""
    shape = ModelShape.from_spec(yaml.safe_load(EXAMPLE.read_text())["spec"]["model"])
    first = results[0]
    step_s = step_time(first.steps[warmup:], first.steps[warmup].time, first.faults[0].at
                       if first.faults else first.steps[-1].time)
    return {
        "format": FORMAT,
        "note": f"measured by `tessera-dev bench recovery` on {os.cpu_count()} cores; the "
                f"checkpoint interval is {interval} steps (the product's default, 1000, would "
                "take the bench's job minutes to reach); the job's nodes, and for "
                f"{', '.join(sorted(SPARES))} a spare node besides (runs.*.nodes)",
        "job": {"gpus": TP * DP, "nodes": JOB_NODES, "gpus_per_node": GPUS, "tp": TP, "pp": 1,
                "dp": DP, "parameters": parameters(shape), "step_seconds": round(step_s, 4),
                "checkpoint_interval_steps": interval,
                "checkpoint_interval_seconds": round(interval * step_s, 3)},
        "policies": {POLICIES[r.policy]: {"faults": [f.to_dict() for f in r.figures]}
                     for r in results},
        "runs": {POLICIES[r.policy]: _rounded(r.run.to_dict() | {
            "status_goodput": r.status_goodput, "load_before": r.load[0],
            "load_after": r.load[1], "nodes": nodes(r.policy)}) | timeline(r)
                 for r in results},
    }


def timeline(result: Result) -> dict[str, Any]:
    """When each fault was injected (`faults_at`) and the layouts the run trained on, in order
    (`trained`): each one's attempt, generation, replicas (each rank's GPU, from its document),
    TP degrees (as its ranks logged them), the first step done on it and when; times in seconds
    from the run's first step."""
    first: dict[tuple[int, int], Step] = {}
    for step in result.steps:
        first.setdefault(step.layout, step)
    t0 = result.steps[0].time
    return {"faults_at": [round(f.at - t0, 4) for f in result.faults], "trained": [
            {"attempt": key[0], "generation": key[1],
             "replicas": [list(r) for r in result.layouts.get(key, ())],
             "tp_degrees": list(step.tp_degrees),
             "first_step": step.step, "first_at": round(step.time - t0, 4)}
            for key, step in first.items()]}


def parameters(shape: ModelShape) -> int:
    """The dense model's parameter count (embedding, every layer's units and norms, output)."""
    from ntp.model import ModelArgs, parameter_shapes  # torch: only when the bench reports

    return sum(math.prod(dims) for dims in parameter_shapes(ModelArgs.of_shape(shape)).values())


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}


def table(results: list[Result]) -> str:
    rows = ["| policy | fault | detection s | pause s | switches | reduced s | steps redone | "
            "layouts (TP per replica) -change pause s-> ... |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for f in r.figures:
            detection = "-" if f.detection_s is None else f"{f.detection_s:.2f}"
            rows.append(f"| {r.policy} | {f.kind} | {detection} | {f.pause_s:.2f} | "
                        f"{len(f.switches)} | {f.reduced_s:.1f} | {f.steps_redone} | "
                        f"{went_through(f)} |")
    rows += ["", "| policy | healthy samples/s | degraded / healthy | goodput time | goodput "
             "step | status goodput | J / sample | load 1-min before / after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        g = r.run
        degraded = "-" if g.degraded_over_healthy is None else f"{g.degraded_over_healthy:.3f}"
        energy = "-" if g.energy_j_per_sample is None else f"{g.energy_j_per_sample:.1f}"
        status = "-" if r.status_goodput is None else f"{r.status_goodput:.3f}"
        rows.append(f"| {r.policy} | {g.healthy_samples_per_s:.1f} | {degraded} | "
                    f"{g.goodput_time:.3f} | {g.goodput_step:.3f} | {status} | {energy} | "
                    f"{r.load[0]:.1f} / {r.load[1]:.1f} |")
    return "\n".join(rows)


def went_through(f: FaultFigures) -> str:
    """The layouts a fault went through, each switch between them with what it did and its
    pause: "3,3 -reshard 0.36-> 2,3"."""
    text = _layout(f.layouts[0])
    for s in f.switches:
        text += f" -{'+'.join(s.changes) or 'same GPUs'} {s.pause_s:.2f}-> {_layout(s.layout)}"
    return text


def _layout(degrees: tuple[int, ...]) -> str:
    return ",".join(map(str, degrees))


def ratios(results: list[Result]) -> list[str]:
    """Per failure, the training time NTP lost against checkpoint-restart's
    (`FaultFigures.lost_s`: pauses, and steps redone at the run's healthy pace), with the
    layouts NTP went through; and NTP's steps redone."""
    by = {r.policy: r for r in results}
    out = []
    if "NTP" in by and "CKPT-RESTART" in by:
        ntp_step, ckpt_step = by["NTP"].run.healthy_step_s, by["CKPT-RESTART"].run.healthy_step_s
        for ntp, ckpt in zip(by["NTP"].figures, by["CKPT-RESTART"].figures, strict=False):
            lost = ckpt.lost_s(ckpt_step)
            if ntp.kind == ckpt.kind and ntp.kind in FAILURE_KINDS and lost > 0:
                out.append(
                    f"{ntp.kind}: NTP lost {ntp.lost_s(ntp_step):.2f} s (pause "
                    f"{ntp.pause_s:.2f} s, {ntp.steps_redone} steps redone; {went_through(ntp)}), "
                    f"CKPT-RESTART {lost:.2f} s (pause {ckpt.pause_s:.2f} s, {ckpt.steps_redone} "
                    f"steps redone at {ckpt_step:.3f} s): NTP / CKPT-RESTART = "
                    f"{ntp.lost_s(ntp_step) / lost:.3f} (target <= 0.1)")
    if "NTP" in by:
        out.append(f"NTP steps redone: {sum(f.steps_redone for f in by['NTP'].figures)} "
                   "(target 0)")
    return out


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.2 * len(results)), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        t0 = r.steps[0].time
        ax.plot([s.time - t0 for s in r.steps], [s.step for s in r.steps], ".", markersize=2)
        for f in r.faults:
            ax.axvline(f.at - t0, color="red", linewidth=0.8)
            ax.annotate(f.kind, (f.at - t0, 0), rotation=90, fontsize=7, color="red",
                        xytext=(2, 2), textcoords="offset points")
        ax.set_ylabel(f"{r.policy}\nstep")
    axes[-1, 0].set_xlabel("seconds since the job's first step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera-dev bench recovery", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated failure policies (default: all five)")
    parser.add_argument("--faults", default=",".join(SEQUENCE),
                        help=f"the fault sequence, in order (default: {','.join(SEQUENCE)})")
    parser.add_argument("--interval", type=int, default=50, help="checkpoint every N steps")
    parser.add_argument("--warmup", type=int, default=5,
                        help="steps left out of the healthy rate")
    parser.add_argument("--settle", type=int, default=8,
                        help="steps on a new layout before the next fault")
    parser.add_argument("--out", type=Path, default=paths.default_data_dir().parent / "bench",
                        help="where recovery.json and recovery.png go (default: %(default)s)")
    opts = parser.parse_args(argv)
    opts.policies = [p for p in opts.policies.split(",") if p]
    opts.faults = tuple(f for f in opts.faults.split(",") if f)
    unknown = [p for p in opts.policies if p not in POLICIES]
    if unknown or not opts.policies:
        parser.error(f"--policies: one or more of {', '.join(POLICIES)}; got {unknown}")
    bad = [f for f in opts.faults if f not in SEQUENCE]
    if bad or not opts.faults:
        parser.error(f"--faults: one or more of {', '.join(SEQUENCE)}; got {bad}")
    for undo, fault in UNDOES.items():
        if undo in opts.faults and fault not in opts.faults[:opts.faults.index(undo)]:
            parser.error(f"--faults: {undo} needs a {fault} before it")
    return opts


def on_own_cluster(policy: str, opts: argparse.Namespace) -> Result:
    """`policy`'s run on a local cluster started for it: a frozen and thawed node, a GPU
    restored, are not left for the next policy to meet."""
    with launcher.ControlPlane.start(bin_dir=launcher.prebuilt()) as plane:
        running = cluster.Cluster.start(plane, cluster.node_specs(nodes(policy), GPUS))
        try:
            install.apply(plane.kubeconfig)
            with plane.api_client() as api:
                install.wait(api, nodes(policy), timeout=HANG_S)
                return bench_policy(plane, running, api, policy, opts.faults, opts.interval,
                                    opts.warmup, opts.settle)
        finally:
            running.stop()


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    results = []
    started = time.monotonic()
    for policy in opts.policies:
        print(f"{policy}: running {', '.join(opts.faults)} ...", flush=True)
        try:
            results.append(on_own_cluster(policy, opts))
        except (FiguresError, TimeoutError, RuntimeError) as exc:
            print(f"{policy}: no figures: {exc}", flush=True)
    if not results:
        print("tessera-dev bench recovery: no policy ran to the end")
        return 1
    doc = document(results, opts.interval, opts.warmup)
    (opts.out / "recovery.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, opts.out / "recovery.png")
    print(table(results))
    print("\n".join(ratios(results)))
    print(f"{len(results)} policies in {time.monotonic() - started:.0f} s on "
          f"{os.cpu_count()} cores; the load averages above are the machine's while each ran "
          "(the control plane, the nodes and the job's ranks share these cores, so every time "
          "includes their contention)")
    print(f"wrote {opts.out / 'recovery.json'} and {opts.out / 'recovery.png'}")
    return 0 if len(results) == len(opts.policies) else 1
