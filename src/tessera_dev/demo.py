"""`tessera-dev demo`: a job trains on the local cluster, one GPU is cordoned and another fails
under it, and the job keeps training at a reduced tensor-parallel degree with its surviving GPUs
boosted.

`tessera-dev up --nodes 2 --gpus-per-node 4` gives a real control plane, two simulated 4-GPU nodes
that run pods as local processes, and Prometheus; a running cluster of that size is reused.
Tessera is installed as on a GPU cluster (`kubectl apply --server-side -k manifests/local`), the
interpreter's standard library is prepared with `tessera prepare-data` into a claim on the
cluster's shared storage, and the example job (`manifests/examples/ntpjob-local.yaml`: TP4 x DP2,
NTP-PW), which mounts that claim and trains on it, is applied with kubectl. Its trainer pods
train on CPU; the view below refreshes every second from the job's status and Prometheus. Then
`tessera cordon-gpu gpu-node-0 3` (planned: the replica drains to TP 3 at a step boundary) and
`tessera-dev fail-gpu gpu-node-1 2 --xid 79` (the GPU falls off the bus and its rank dies; the
survivors continue at TP 3). Every cluster action is a command a user types, so each can be
repeated by hand. At the end a PNG of goodput, TP degree per replica, power per GPU and the loss
over the demo, and the queries and commands to look further. Cluster, operator, job and
Prometheus keep running until `tessera-dev down`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from rich.console import Console
from rich.live import Live

from tessera_cli import main as tessera_cli
from tessera_contracts import gpuhealth
from tessera_contracts.api import GPU_HEALTH_PLURAL, GROUP, JOB_LABEL, JOB_PLURAL, VERSION
from tessera_contracts.gpuhealth import State
from tessera_dev import demo_data, demo_plot, install, paths, probes, processes
from tessera_dev.controlplane import cluster, launcher, up
from tessera_dev.controlplane.prometheus import Prometheus
from tessera_dev.demo_view import DRAW, Snapshot, observe, render
from tessera_operator.workload import GPU_RESOURCE

REPO = paths.repo_root()
EXAMPLE = REPO / "manifests" / "examples" / "ntpjob-local.yaml"
LOCAL_INSTALL = REPO / "manifests" / "local"
SYSTEM_NS = "tessera-system"
NODE_COUNT, GPUS = 2, 4
NODES = [f"{cluster.NODE_PREFIX}{k}" for k in range(NODE_COUNT)]
CORDONED = (NODES[0], 3)
FAILED = (NODES[1], 2)
# Enough steps that the job is still training long after the demo, for the user to look at.
STEPS = 1_000_000
REFRESH_S = 1.0
# Training shown before the first fault (a few seconds of the local job).
TRAINED_STEPS = 50
# Guards against something that never comes, not targets: the trainer pods' first steps wait
# for eight ranks to import torch on whatever cores the machine has.
INSTALL_S = 180.0
TRAINING_S = 300.0
REACTION_S = 180.0
RECOVERY_S = 300.0
GPU_LOST_ALERT = "TesseraGPULost"
# The same interpreter as this command, so the demo never picks up another installation.
COMMANDS = {"tessera": (sys.executable, "-m", "tessera_cli.main"),
            "tessera-dev": (sys.executable, "-m", "tessera_dev.cli")}


class DemoError(Exception):
    """Something the demo needs did not happen; the message is what the user sees."""


@dataclass
class Demo:
    console: Console
    running: cluster.Cluster
    api: client.ApiClient
    job: str
    namespace: str
    base_watts: float
    yes: bool
    events: list[tuple[float, str]] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return self.running.plane.kubeconfig

    @property
    def prometheus(self) -> Prometheus:
        return self.running.prometheus

    def _run(self, argv: list[str], shown: str, stdin: str | None = None) -> str:
        self.console.print(f"$ {shown}", style="bold", markup=False, highlight=False)
        env = os.environ | {"KUBECONFIG": str(self.kubeconfig),
                            "TESSERA_STATE_DIR": str(self.running.plane.data_dir.parent)}
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120,
                              env=env)
        out = (done.stdout + done.stderr).rstrip()
        if done.returncode != 0:
            raise DemoError(f"`{shown}` failed (exit {done.returncode}): {out}")
        self.console.print(out, markup=False, highlight=False, soft_wrap=True)
        return out

    def kubectl(self, *args: str, stdin: str | None = None, shown: str | None = None) -> str:
        return self._run(["kubectl", *args], shown or f"kubectl {' '.join(args)}", stdin)

    def tessera(self, *args: str) -> str:
        """A production verb through `tessera`, the local cluster's through `tessera-dev`."""
        name = "tessera" if args[0] in tessera_cli.COMMANDS else "tessera-dev"
        return self._run([*COMMANDS[name], *args], f"{name} {' '.join(args)}")

    def observe(self) -> Snapshot:
        return observe(self.api, self.prometheus, self.namespace, self.job)

    def until(self, what: str, done: Callable[[Snapshot], bool],
              timeout: float = REACTION_S) -> Snapshot:
        """Show the live view until `done` holds, then leave its last frame on screen."""
        started = time.monotonic()

        def view(snap: Snapshot, note: str) -> object:
            return render(snap, self.job, NODES, GPUS, self.base_watts, note)

        snap = self.observe()
        with Live(view(snap, f"waiting: {what}"), console=self.console, auto_refresh=False,
                  transient=True) as live:
            while not done(snap):
                waited = time.monotonic() - started
                if waited > timeout:
                    raise DemoError(
                        f"{what}: not reached in {timeout:.0f} s (phase {snap.phase or '-'}, "
                        f"TP {snap.tp_layout or '-'}, step {snap.step}); look at `kubectl get "
                        f"ntpjob,pods -o wide` and `kubectl logs` with KUBECONFIG="
                        f"{self.kubeconfig}")
                time.sleep(REFRESH_S)
                snap = self.observe()
                live.update(view(snap, f"waiting ({waited:.0f} s): {what}"), refresh=True)
        self.console.print(view(snap, f"done in {time.monotonic() - started:.0f} s: {what}"))
        return snap

    def fault(self, question: str, *command: str) -> int:
        """Ask (unless --yes), run the `tessera` command, mark it on the figure; the step the
        job had reported when it ran."""
        if not self.yes:
            try:
                self.console.input(f"[bold yellow]{question}[/] (Enter to go on) ")
            except EOFError:
                self.console.print()  # the prompt's line is left open
                raise DemoError("no answer on stdin; `tessera-dev demo --yes` runs without "
                                "asking") from None
        step = self.observe().step
        self.events.append((time.time(), " ".join(command[:3])))
        self.tessera(*command)
        return step


def _fail(console: Console, message: str) -> int:
    console.print(f"tessera-dev demo: {message}", style="red", markup=False, highlight=False,
                  soft_wrap=True)
    return 1


def _gpus_per_node(plane: launcher.ControlPlane) -> dict[str, int]:
    with plane.api_client() as api:
        nodes = client.CoreV1Api(api).list_node(_request_timeout=10).items
    return {n.metadata.name: int((n.status.capacity or {}).get(GPU_RESOURCE, 0)) for n in nodes}


def _cluster(console: Console) -> tuple[cluster.Cluster, bool]:
    """The local cluster of 2 nodes x 4 GPUs, started or reused; and whether it was reused."""
    if shutil.which("kubectl") is None:
        raise DemoError("kubectl is not on the PATH: install it first")
    data_dir = paths.default_data_dir()
    existing = cluster.Cluster.load(data_dir)
    reused = existing is not None and existing.is_running() and bool(existing.nodes)
    if reused:
        assert existing is not None
        sizes = _gpus_per_node(existing.plane)
        if sizes != dict.fromkeys(NODES, GPUS):
            shape = ", ".join(f"{n}: {g} GPUs" for n, g in sorted(sizes.items())) or "no nodes"
            raise DemoError(f"a local cluster is running in {data_dir} ({shape}); the demo "
                            f"needs {NODE_COUNT} nodes of {GPUS} GPUs. Stop it with "
                            "`tessera-dev down`, or set TESSERA_STATE_DIR to start another")
    console.rule(f"tessera-dev up --nodes {NODE_COUNT} --gpus-per-node {GPUS}")
    if up.main(["--nodes", str(NODE_COUNT), "--gpus-per-node", str(GPUS)]) != 0:
        raise DemoError("the local cluster did not start (the lines above say why)")
    running = cluster.Cluster.load(data_dir)
    if running is None or running.prometheus_url is None:
        raise DemoError(f"the local cluster recorded no Prometheus in {data_dir}")
    return running, reused


def _wait(console: Console, what: str, probe: Callable[[], bool], timeout: float) -> None:
    started = time.monotonic()
    with console.status(what):
        probes.poll_until(probe, timeout=timeout, interval=REFRESH_S,
                          error=lambda _: DemoError(f"{what}: not done in {timeout:.0f} s"))
    console.print(f"{what}: done in {time.monotonic() - started:.0f} s")


def _job_gone(api: client.ApiClient, namespace: str, job: str) -> bool:
    """The job, its layout ConfigMap and its trainer pods are all deleted: a job of the same
    name created now is not refused the ConfigMap of the last one."""
    core = client.CoreV1Api(api)
    try:
        core.read_namespaced_config_map(f"{job}-layout", namespace, _request_timeout=10)
        return False
    except ApiException as exc:
        if exc.status != 404:
            raise
    return not core.list_namespaced_pod(namespace, label_selector=f"{JOB_LABEL}={job}",
                                        _request_timeout=10).items


def _start_over(demo: Demo) -> None:
    """On a reused cluster: the last demo's job deleted, its GPUs given back."""
    try:
        client.CustomObjectsApi(demo.api).get_namespaced_custom_object(
            GROUP, VERSION, demo.namespace, JOB_PLURAL, demo.job,
            _request_timeout=10)
    except ApiException as exc:
        if exc.status != 404:
            raise
    else:
        demo.kubectl("delete", "ntpjob", demo.job, "--wait=true", "--timeout=120s")
    _wait(demo.console, "the earlier job's layout and pods deleted",
          lambda: _job_gone(demo.api, demo.namespace, demo.job), INSTALL_S)
    demo.tessera("uncordon-gpu", CORDONED[0], str(CORDONED[1]))
    demo.tessera("restore-gpu", FAILED[0], str(FAILED[1]))
    # Until the exporter's XID window has passed, the restored GPU still counts as failed and
    # the job would start degraded.
    _wait(demo.console, "the restored GPU healthy again (the XID leaves the exporter's window)",
          lambda: _healthy(demo.api), RECOVERY_S)


def _dataset(demo: Demo, example: Mapping[str, Any]) -> None:
    """The claim the job reads its dataset from, on the cluster's shared storage, with the
    standard library prepared into it; on a reused cluster the one there already (the command
    finds its own dataset and changes nothing)."""
    where = demo_data.data_claim(example)
    demo.console.rule(f"the dataset: the interpreter's standard library on claim {where.name}")
    demo.running.shared_volume(demo.api, where.name, demo.namespace, size="1Gi")
    out = demo.running.shared_path(where.name, demo.namespace) / where.path
    demo.tessera(*demo_data.prepare_args(out, example["spec"]["model"]["vocab"]))


def _healthy(api: client.ApiClient) -> bool:
    """Every node's GPUHealth names no GPU failed, unknown or with a recent XID."""
    items = client.CustomObjectsApi(api).list_cluster_custom_object(
        GROUP, VERSION, GPU_HEALTH_PLURAL, _request_timeout=10)["items"]
    try:
        published = [gpuhealth.parse(item) for item in items]
    except gpuhealth.MalformedHealth:
        return False
    return {p.node for p in published} >= set(NODES) and all(
        g.state is State.HEALTHY and not g.xids for p in published for g in p.health.gpus)


def _queries(job: str, alerts: bool) -> list[tuple[str, str]]:
    found = [
        ("goodput of each node's trainer", f'tessera_goodput_ratio{{ntpjob="{job}"}}'),
        ("badput seconds by category",
         f'sum by (category) (tessera_badput_seconds_total{{ntpjob="{job}"}})'),
        ("TP degree of each replica",
         f'max by (replica) (tessera_replica_tp_degree{{ntpjob="{job}"}})'),
        ("power limit per GPU, set by the power agents", "tessera_gpu_power_limit_watts"),
        ("power draw per GPU (dcgm-exporter 4.8 or 4.9)", DRAW),
        ("loss of the last step, per node", f'tessera_loss{{ntpjob="{job}"}}'),
    ]
    if alerts:
        found.append(("the lost GPU, as an alert", f'ALERTS{{alertname="{GPU_LOST_ALERT}"}}'))
    return found


def _alert_loaded(prometheus: Prometheus) -> bool:
    return any(rule.get("name") == GPU_LOST_ALERT
               for group in prometheus.rules() for rule in group.get("rules", []))


def _epilogue(demo: Demo, figure: Path, alerts: bool) -> None:
    console, job = demo.console, demo.job
    console.rule("still running")
    console.print(f"The cluster, the operator, Prometheus and the job ({STEPS:,} steps) keep "
                  "running until `tessera-dev down`.", markup=False)
    console.print(f"figure: {figure}  (its series: {figure.with_suffix('.json')})", markup=False)
    console.rule(f"PromQL: paste at {demo.prometheus.url}/graph")
    for what, promql in _queries(job, alerts):
        console.print(f"# {what}\n{promql}", markup=False, highlight=False, soft_wrap=True)
    console.rule("kubectl and tessera")
    kubectl = [
        f"export KUBECONFIG={demo.kubeconfig}",
        f"kubectl get ntpjob {job} -o wide   # phase, TP layout, step, goodput",
        f"kubectl get pods -o wide -l tessera.dev/job={job}   # the trainer pods",
        f"kubectl logs -l tessera.dev/job={job},tessera.dev/role=trainer --tail=5",
        f"kubectl get configmap {job}-layout -o jsonpath='{{.data.generation\\.json}}'",
        "kubectl get gpupowertargets -o yaml   # what the operator asked of the power agents",
        f"kubectl logs -n {SYSTEM_NS} deploy/tessera-operator",
        f"tessera uncordon-gpu {CORDONED[0]} {CORDONED[1]}   # gives the cordoned GPU back",
        f"tessera-dev restore-gpu {FAILED[0]} {FAILED[1]}   # the failed GPU comes back",
        "tessera-dev down   # stops everything",
    ]
    console.print("\n".join(kubectl), markup=False, highlight=False, soft_wrap=True)


def _demo(args: argparse.Namespace, console: Console) -> int:
    example = yaml.safe_load(EXAMPLE.read_text())
    job, namespace = example["metadata"]["name"], example["metadata"].get("namespace", "default")
    example["spec"]["steps"] = STEPS
    base = float(example["spec"]["powerPolicy"]["baseCapWatts"])

    # 1. the cluster, Tessera on it, the job applied as a user applies it
    running, reused = _cluster(console)
    with running.plane.api_client() as api:
        demo = Demo(console, running, api, job, namespace, base, args.yes)
        console.rule("Tessera, installed as on a GPU cluster")
        demo.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(LOCAL_INSTALL))
        _wait(console, "the operator's replicas and a power agent per node Ready",
              lambda: install.missing(api, NODE_COUNT) is None, INSTALL_S)
        if reused:
            _start_over(demo)
        _dataset(demo, example)
        console.rule(f"the job: {EXAMPLE.relative_to(REPO)} with steps: {STEPS}")
        demo.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(example),
                     shown=f"kubectl apply -f {EXAMPLE.relative_to(REPO)}")
        start = time.time()

        # 2. training: two TP4 replicas, one per node, every GPU at the base cap
        demo.until(f"the job training at TP 4,4 (step {TRAINED_STEPS}), goodput in "
                   "Prometheus, every GPU at the base cap",
                   lambda s: s.phase == "Running" and s.tp_layout == "4,4"
                   and s.trainers_at(4, 4) and s.step >= TRAINED_STEPS
                   and set(s.goodput) == set(NODES)
                   and all(set(s.limits.get(n, {}).values()) == {base} for n in NODES),
                   TRAINING_S)

        # 3. a planned cordon, then a GPU lost under its rank
        node, gpu = CORDONED
        console.rule(f"cordon GPU {gpu} of {node}")
        demo.fault(f"Cordon GPU {gpu} of {node}?", "cordon-gpu", node, str(gpu))
        demo.until(f"the replica on {node} training at TP 3 (layout 3,4), its survivors "
                   f"boosted above {base:.0f} W",
                   lambda s: s.tp_layout == "3,4" and s.phase == "Degraded"
                   and s.trainers_at(3, 4) and s.boosted(node, base))
        node, gpu = FAILED
        console.rule(f"GPU {gpu} of {node} falls off the bus")
        at = demo.fault(f"Fail GPU {gpu} of {node} (XID 79)?", "fail-gpu", node, str(gpu),
                        "--xid", "79")
        demo.until(f"the replica on {node} training on at TP 3 (layout 3,3), its survivors "
                   f"boosted above {base:.0f} W",
                   lambda s: s.tp_layout == "3,3" and s.trainers_at(3, 3) and s.step > at
                   and s.boosted(node, base))
        demo.until(f"the survivors on {CORDONED[0]} ramped to their boosted targets",
                   lambda s: s.at_targets([CORDONED[0]]) and s.boosted(CORDONED[0], base))
        alerts = _alert_loaded(demo.prometheus)
        if alerts:
            demo.prometheus.wait_for(f'ALERTS{{alertname="{GPU_LOST_ALERT}",'
                                     'alertstate="firing"}', timeout=REACTION_S)

        # 4. the figure, from Prometheus' range queries over the demo
        figure = args.out.resolve()
        with console.status("the figure: Prometheus range queries"):
            data = demo_plot.collect(demo.prometheus.url, job, start, time.time())
            demo_plot.draw(data, job, demo.events, start, figure)
        _epilogue(demo, figure, alerts)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-dev demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yes", action="store_true",
                        help="inject the faults without asking (unattended)")
    parser.add_argument("--out", type=Path,
                        default=paths.default_data_dir().parent / "demo" / "tessera-demo.png",
                        help="the figure's path (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console()
    try:
        return _demo(args, console)
    except (DemoError, processes.StartupError, TimeoutError) as exc:
        return _fail(console, str(exc))
    except (ApiException, OSError, subprocess.SubprocessError, ValueError) as exc:
        return _fail(console, f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        _fail(console, "interrupted; whatever started keeps running until `tessera-dev down`")
        return 130


if __name__ == "__main__":
    sys.exit(main())
