"""The user's flow end to end on the local cluster, driven as a user drives it.

Tessera installed from the shipped manifests (local overlay) on a cluster of its own; the
example job applied with kubectl; then a GPU cordoned with `tessera cordon-gpu`, another failed
with `tessera-dev fail-gpu` (its rank is killed, as a GPU falling off the bus kills its process),
the cordon lifted, and the run stopped with `kubectl delete` once it trains on the last layout
(the example's 100000 steps outlast any wait here, so no change can come after the job's end).
Asserted: the trainer pods train; each change reaches the ranks as a new generation and the
healthy replica's processes carry on (no new process on its node except on a returned GPU);
every step up to the stop was done once, and its losses equal a failure-free run of as many
steps of the same job (same seed, same first layout, the local launcher) within 1e-4; goodput
and the job's status are in Prometheus and the API. The figures (reaction times
against a checkpoint restart measured in the same run) are printed, not asserted.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import yaml
from kubernetes import client

from ntp.launch import launch_local
from tessera_agents.power.sim_backend import SimGpuSpec
from tessera_contracts.generation import Generation, Gpu, Rendezvous
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.powertarget import parse_object
from tessera_dev import demo_data, install, paths, probes
from tessera_dev.controlplane import cluster, launcher
from tessera_dev.reference import trainer_options

pytestmark = pytest.mark.e2e

NODES, GPUS = 2, 4
JOB = "tiny-llama"
ROOT = paths.repo_root()
EXAMPLE = ROOT / "manifests/examples/ntpjob-local.yaml"
POWER = yaml.safe_load(EXAMPLE.read_text())["spec"]["powerPolicy"]
BASE_WATTS, BUDGET_WATTS = POWER["baseCapWatts"], POWER["rackBudgetWatts"]
MIN_WATTS = SimGpuSpec().min_w  # the simulated nodes' GPUs
# Guards against a hang, not bounds on how fast anything reacts.
PHASE_S = 180.0
# The console script of this environment, as a user on its PATH runs it.
TESSERA = str(Path(sys.executable).parent / "tessera")
TESSERA_DEV = str(Path(sys.executable).parent / "tessera-dev")


wait = functools.partial(probes.wait_for, timeout=PHASE_S)


@dataclass
class Flow:
    plane: launcher.ControlPlane
    api: client.ApiClient
    prometheus: str
    namespace: str = "default"

    def run(self, *argv: str) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              env=os.environ | {"KUBECONFIG": str(self.plane.kubeconfig)})
        assert done.returncode == 0, (argv, done.stdout, done.stderr)
        return done.stdout

    def cordon(self, command: str, node: str, gpu: int) -> str:
        """`tessera cordon-gpu` or `uncordon-gpu`, against this cluster."""
        return self.run(TESSERA, command, node, str(gpu), "--kubeconfig",
                        str(self.plane.kubeconfig))

    def fault(self, command: str, node: str, gpu: int, *more: str) -> str:
        """`tessera-dev fail-gpu` or `restore-gpu` on this cluster's simulated node."""
        return self.run(TESSERA_DEV, command, node, str(gpu), *more, "--data-dir",
                        str(self.plane.data_dir))

    def status(self) -> dict[str, Any]:
        return json.loads(self.run("kubectl", "get", "ntpjob", JOB, "-o", "json")).get(
            "status") or {}

    def logs(self, pod: str) -> list[str]:
        return self.run("kubectl", "logs", pod).splitlines()

    def generation(self) -> dict[str, Any]:
        cm = client.CoreV1Api(self.api).read_namespaced_config_map(f"{JOB}-layout",
                                                                   self.namespace)
        return json.loads(cm.data["generation.json"])

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?query={urllib.parse.quote(promql)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())["data"]["result"]

    def target_watts(self, node: str) -> dict[int, int]:
        """Every GPU's watts in the node's GPUPowerTarget, as `kubectl get` shows it and its
        agent reads it."""
        target = parse_object(json.loads(self.run(
            "kubectl", "get", "gpupowertarget", node, "-o", "json")), node)
        return {i: target.watts_for(i) for i in range(GPUS)}

    def limits(self, node: str) -> dict[int, float]:
        """Every GPU's power limit on `node` as Prometheus last scraped it from its agent."""
        return {int(s["metric"]["gpu"]): float(s["value"][1]) for s in self.query(
            f'tessera_gpu_power_limit_watts{{node="{node}"}}')}


@pytest.fixture(scope="module")
def flow() -> Iterator[Flow]:
    """A cluster of its own (2 nodes x 4 GPUs) with Tessera installed as a user installs it."""
    with launcher.ControlPlane.start(bin_dir=launcher.prebuilt()) as plane:
        running = cluster.Cluster.start(plane, cluster.node_specs(NODES, GPUS))
        try:
            with plane.api_client() as api:
                flow = Flow(plane, api, running.prometheus_url)
                install.apply(plane.kubeconfig)
                install.wait(api, NODES)
                yield flow
        finally:
            running.stop()


def _records(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _started(lines: list[str]) -> list[str]:
    """The agent's lines saying it started a rank process."""
    return [line for line in lines if " of generation " in line and ": pid " in line]


def _reconfigured_at(flow: Flow, pod: str, generation: int) -> float | None:
    """When the pod's ranks resumed on `generation` (None: not yet)."""
    return min((r["time"] for r in _records(flow.logs(pod))
                if r.get("event") == "reconfigured" and r.get("generation") == generation),
               default=None)


def _switched(flow: Flow, pod: str, generation: int, since: float) -> tuple[float, float]:
    """Seconds from `since` to the pod's ranks training on `generation`, and the part of it
    after the generation reached the pod's agent."""
    at = wait(f"{pod}'s ranks on generation {generation}",
              lambda: _reconfigured_at(flow, pod, generation), lambda t: t is not None)
    return at - since, at - _received_at(flow, pod, generation)


def _received_at(flow: Flow, pod: str, generation: int) -> float:
    """When the pod's agent saw `generation` in the layout ConfigMap (its log line's time)."""
    line = next(line for line in flow.logs(pod)
                if "ntp.nodeagent.kube_source" in line
                and line.endswith(f": generation {generation}"))
    # logging's asctime is local time, as a naive datetime's timestamp() reads it
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _failure_free(tmp: Path, steps: int) -> tuple[dict[int, float], float]:
    """Global rank 0's losses by step on TP4 + TP4 throughout its first `steps` steps (the
    local launcher), and how long a checkpoint restart of the same job onto TP3 + TP4 takes to
    its first step there."""
    spec = demo_data.without_dataset(yaml.safe_load(EXAMPLE.read_text()))["spec"]
    typed = NTPTrainingJobSpec.from_spec(spec)

    def run(replicas: tuple[tuple[Gpu, ...], ...], args: list[str]) -> None:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        first = Generation(1, typed.model.shape(), typed.global_batch, typed.failure_policy.mode,
                           replicas, Rendezvous("127.0.0.1", store.port))
        launch_local(first, [*args, *trainer_options(typed)], timeout_s=600, store=store)

    full = tuple(tuple(Gpu(f"gpu-node-{r}", i) for i in range(GPUS)) for r in range(NODES))
    save = tmp / "checkpoints"
    run(full, ["--until-step", str(steps), "--out", str(tmp), "--save", str(save)])
    losses = json.loads((tmp / "rank0.json").read_text())
    by_step = dict(zip(sorted(map(int, losses["step_ends"])), losses["losses"], strict=True))
    t0 = time.monotonic()
    run((full[0][: GPUS - 1], full[1]),
        ["--until-step", str(steps + 1), "--save", str(save), "--resume"])
    return by_step, time.monotonic() - t0


def test_kubectl_apply_cordon_fail_and_uncordon(flow: Flow, tmp_path: Path) -> None:
    # 1. kubectl apply: the operator places the job, its pods train.
    # Synthetic sequences, as the failure-free run trains.
    job = demo_data.without_dataset(yaml.safe_load(EXAMPLE.read_text()))
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    flow.run("kubectl", "apply", "-f", str(manifest))
    status = wait("the job Running past step 10", flow.status,
                  lambda s: s.get("phase") == "Running" and s.get("step", 0) >= 10)
    assert status["tpLayout"] == "4,4"
    pods = {p.spec.node_name: p.metadata.name for p in client.CoreV1Api(
        flow.api).list_namespaced_pod(flow.namespace, label_selector=f"tessera.dev/job={JOB},"
                                      "tessera.dev/role=trainer").items}
    assert sorted(pods) == [f"gpu-node-{r}" for r in range(NODES)]
    cordoned, failed = "gpu-node-0", "gpu-node-1"

    # 2. Cordon GPU 3 of node 0: its replica goes to TP 3 at a step boundary; node 1's
    #    processes carry on.
    before = _started(flow.logs(pods[failed]))
    t_cordon = time.time()
    flow.cordon("cordon-gpu", cordoned, 3)
    second = wait("generation 2", flow.generation, lambda g: g["generation"] == 2)
    assert [len(r["gpus"]) for r in second["replicas"]] == [3, 4]
    assert second.get("atStep") is not None  # a drain: planned, at a step boundary
    cordon_s, cordon_switch_s = _switched(flow, pods[failed], 2, t_cordon)
    assert _started(flow.logs(pods[failed])) == before
    wait("Degraded 3,4", flow.status,
         lambda s: (s.get("phase"), s.get("tpLayout")) == ("Degraded", "3,4"))
    # The drained GPU's power pays for its survivors: their targets are raised, and the
    # limits the agent sets follow (ramped), inside the node's budget.
    targets = wait("node 0's survivors' targets raised", lambda: flow.target_watts(cordoned),
                   lambda w: w[3] == MIN_WATTS and min(w[i] for i in range(3)) > BASE_WATTS)
    assert sum(targets.values()) <= BUDGET_WATTS
    wait("node 0's survivors above the base cap in Prometheus", lambda: flow.limits(cordoned),
         lambda w: len(w) == GPUS and min(w[i] for i in range(3)) > BASE_WATTS)

    # 3. Fail GPU 2 of node 1 outright: its rank dies; the survivors reconfigure, no restart.
    healthy_before = _started(flow.logs(pods[cordoned]))
    t_fail = time.time()
    out = flow.fault("fail-gpu", failed, 2, "--xid", "79")
    assert "killed the processes holding it" in out and "none" not in out
    third = wait("generation 3", flow.generation, lambda g: g["generation"] == 3)
    layout_s = time.time() - t_fail
    assert [len(r["gpus"]) for r in third["replicas"]] == [3, 3]
    assert "atStep" not in third  # a loss: the survivors join it at once
    fail_s, fail_switch_s = _switched(flow, pods[cordoned], 3, t_fail)
    # Neither replica restarted a process: node 1's survivors and node 0's ranks carry on.
    assert _started(flow.logs(pods[failed])) == before
    assert _started(flow.logs(pods[cordoned])) == healthy_before
    # Prometheus evaluates the shipped rules: the lost GPU's alert fires.
    wait("TesseraGPULost firing for the lost GPU", lambda: flow.query(
        'ALERTS{alertname="TesseraGPULost",alertstate="firing"}'),
        lambda r: [(a["metric"].get("hostname"), a["metric"].get("gpu")) for a in r] == [
            (failed, "2")])
    # The lost GPU cannot be cut: its agent counts it at its last limit (the base cap), and
    # the operator plans it there, so the survivors' targets are raised to what the budget
    # holds beyond it, and their limits reach exactly those targets.
    survivors = (0, 1, 3)
    targets = wait("node 1's survivors' targets raised", lambda: flow.target_watts(failed),
                   lambda w: min(w[i] for i in survivors) > BASE_WATTS)
    assert targets[2] == BASE_WATTS and sum(targets.values()) <= BUDGET_WATTS, targets
    # (the boost loop may move the targets meanwhile: each poll reads both)
    targets, limits = wait("node 1's survivors at their targets in Prometheus",
                           lambda: (flow.target_watts(failed), flow.limits(failed)),
                           lambda tl: all(tl[1].get(i) == tl[0][i] for i in survivors))
    assert sum(limits[i] for i in survivors) + BASE_WATTS <= BUDGET_WATTS, limits
    pod_phases = {p.metadata.name: p.status.phase for p in client.CoreV1Api(
        flow.api).list_namespaced_pod(flow.namespace).items}
    assert set(pod_phases.values()) == {"Running"}, pod_phases

    # 4. Uncordon: TP 4 again on node 0, with a new rank on the returned GPU.
    flow.cordon("uncordon-gpu", cordoned, 3)
    # the job's status rides along: a timeout shows what the operator made of the uncordon
    fourth, _ = wait("generation 4", lambda: (flow.generation(), flow.status()),
                     lambda gs: gs[0]["generation"] == 4)
    assert [len(r["gpus"]) for r in fourth["replicas"]] == [4, 3]
    wait("a rank started on the returned GPU", lambda: [
        line for line in flow.logs(pods[cordoned])
        if "generation 4 on gpu-node-0/3" in line and "(joining)" in line])

    # 5. Goodput in Prometheus while it trains (the trainer pods are scraped through their
    #    annotations): productive and badput seconds add up to the wall time, and the
    #    reconfigurations show as badput of their own.
    def accounts() -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        job = f'ntpjob="{JOB}"'
        for name, query in (("wall", f"tessera_wall_seconds_total{{{job}}}"),
                            ("productive", f"tessera_productive_seconds{{{job}}}"),
                            ("badput", f"sum by (node) (tessera_badput_seconds_total{{{job}}})"),
                            ("ratio", f"tessera_goodput_ratio{{{job}}}"),
                            ("reconfiguration", "tessera_badput_seconds_total"
                             f'{{{job},category="reconfiguration"}}')):
            for sample in flow.query(query):
                out.setdefault(sample["metric"]["node"], {})[name] = float(sample["value"][1])
        return out

    scraped = wait("goodput of both nodes in Prometheus", accounts,
                   lambda a: len(a) == NODES and all(len(v) == 5 for v in a.values()))
    for node, a in scraped.items():
        assert a["productive"] + a["badput"] == pytest.approx(a["wall"], rel=0.01), (node, a)
        assert 0 < a["ratio"] <= 1 and a["reconfiguration"] > 0, (node, a)

    # 6. The user stops the run once both replicas train on the last layout: every step up to
    #    then was done once, with the losses of the failure-free run of as many steps.
    wait("both nodes' ranks training on generation 4", lambda: {
        node for node, pod in pods.items() for r in _records(flow.logs(pod))
        if r.get("generation") == 4 and "loss" in r}, lambda nodes: len(nodes) == NODES)
    running = flow.status()
    assert running["phase"] == "Degraded" and 0 < running["goodput"] <= 1, running  # TP 4,3
    logs = {pod: flow.logs(pod) for pod in pods.values()}  # the pods' logs go with them
    flow.run("kubectl", "delete", "ntpjob", JOB, "--wait=true")
    wait("the job's pods gone", lambda: client.CoreV1Api(flow.api).list_namespaced_pod(
        flow.namespace, label_selector=f"tessera.dev/job={JOB}").items, lambda left: not left)
    steps_by_generation: dict[int, set[int]] = {}
    losses: dict[int, float] = {}
    for lines in logs.values():
        for r in _records(lines):
            if "loss" in r:
                steps_by_generation.setdefault(r["generation"], set()).add(r["step"])
                losses.setdefault(r["step"], r["loss"])
                assert r["loss"] == pytest.approx(losses[r["step"]], abs=1e-6)
    steps = max(losses)
    assert sorted(losses) == list(range(1, steps + 1))
    spans = [(min(s), max(s)) for _, s in sorted(steps_by_generation.items())]
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False)), spans  # none redone
    # The same job without failures, for its losses, and a checkpoint restart to compare.
    failure_free, restart_s = _failure_free(tmp_path, steps)
    assert sorted(failure_free) == list(range(1, steps + 1))
    assert losses == pytest.approx(failure_free, abs=1e-4)

    print(f"\n{steps} steps; fail-gpu -> generation 3 in the layout ConfigMap: {layout_s:.2f} s "
          "(the health agent reads its exporter every 2 s, Prometheus scrapes every 1 s); "
          f"cordon -> node 1's ranks training on the new layout: {cordon_s:.2f} s "
          f"({cordon_switch_s:.2f} s of it from the generation reaching the node); fail-gpu -> "
          f"node 0's ranks on the new layout: {fail_s:.2f} s ({fail_switch_s:.2f} s); "
          f"checkpoint restart onto TP3+TP4 (processes started, checkpoint loaded, 1 step): "
          f"{restart_s:.2f} s; ratios {cordon_s / restart_s:.2f} "
          f"({cordon_switch_s / restart_s:.2f}), {fail_s / restart_s:.2f} "
          f"({fail_switch_s / restart_s:.2f})")
