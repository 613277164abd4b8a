"""`tessera demo`: the user's flow on one machine, against a real local control plane.

A real kube-apiserver + etcd, the shipped RBAC, two simulated 8-GPU nodes, the operator and one
power agent per node (simulated NVML backend) under their own service accounts, and Prometheus
scraping the agents. Then what a user does: `kubectl apply` the example job, cordon a GPU, watch
the layout and the power limits change, uncordon it. Cluster actions go through `kubectl` and
the `tessera` commands a user would type, so everything shown can be repeated by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from tessera_operator import paths, simnodes
from tessera_operator.controlplane import launcher, manifests, probes, processes, up
from tessera_operator.controlplane.prometheus import Prometheus

REPO = paths.repo_root()
EXAMPLE = REPO / "manifests" / "examples" / "ntpjob-small.yaml"
RBAC = [REPO / "manifests" / "power-controller" / "rbac.yaml",
        REPO / "manifests" / "power-controller" / "admission.yaml",
        REPO / "manifests" / "operator" / "rbac.yaml"]
SYSTEM_NS = "tessera-system"
NODES = ("gpu-node-0", "gpu-node-1")
FAILED_GPU = 3
REACTION_S = 60.0
# The same interpreter as this command, so the demo never picks up another installation.
TESSERA = (sys.executable, "-m", "tessera_operator.cli")


def _kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def _tessera(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TESSERA, *args],
                          capture_output=True, text=True, timeout=60)


def _show(console: Console, title: str, result: subprocess.CompletedProcess) -> None:
    console.rule(title)
    console.print((result.stdout + result.stderr).rstrip(), markup=False, highlight=False)


def _invalid_variant(example: dict) -> str:
    """The example with a boost cap under the base cap: the CRD's CEL rule must refuse it."""
    bad = {**example, "metadata": {"name": "boost-below-base"}}
    bad["spec"] = {**example["spec"],
                   "powerPolicy": {**example["spec"]["powerPolicy"], "boostCapWatts": 400}}
    return yaml.safe_dump(bad)


def _account_kubeconfig(plane: launcher.ControlPlane, work: Path, account: str) -> Path:
    token = plane.service_account_token(SYSTEM_NS, account)
    path = work / f"{account}.kubeconfig"
    path.write_text(yaml.safe_dump(plane.token_kubeconfig(
        token, f"system:serviceaccount:{SYSTEM_NS}:{account}")))
    return path


@contextlib.contextmanager
def _components(plane: launcher.ControlPlane, work: Path, namespace: str,
                console: Console) -> Iterator[Prometheus]:
    """Operator + power agents as real processes under their service accounts, and Prometheus
    scraping the agents; all stopped (agents restore their GPUs' defaults) on exit."""
    operator_cfg = _account_kubeconfig(plane, work, "tessera-operator")
    agent_cfg = _account_kubeconfig(plane, work, "tessera-power-agent")
    ports = processes.free_ports(len(NODES))
    procs = [processes.spawn(
        [*TESSERA, "operator", "--kubeconfig", str(operator_cfg),
         "--namespace", namespace], work / "operator.log", die_with_parent=True)]
    for node, port in zip(NODES, ports, strict=True):
        procs.append(processes.spawn(
            [*TESSERA, "power-agent", "--node", node, "--backend", "sim",
             "--sim-state", str(work / f"{node}.gpus.json"), "--state-dir", str(work / node),
             "--kubeconfig", str(agent_cfg), "--interval", "1", "--metrics-addr", "127.0.0.1",
             "--metrics-port", str(port)], work / f"power-agent-{node}.log",
            die_with_parent=True))
    console.print(f"operator and {len(NODES)} power agents running (logs in {work})")
    try:
        with Prometheus.start({"tessera-power": [f"127.0.0.1:{p}" for p in ports]},
                              data_dir=work / "prometheus") as prometheus:
            console.print(f"Prometheus: {prometheus.url}")
            yield prometheus
    finally:
        for proc in procs:
            processes.stop_group(proc)


def _job_state(kubeconfig: Path, name: str) -> tuple[str, str]:
    got = _kubectl(kubeconfig, "get", "ntpjob", name, "-o",
                   "jsonpath={.status.phase} {.status.tpLayout}")
    phase, _, layout = got.stdout.partition(" ")
    return phase, layout


def _wait(what: str, probe: Callable[[], Any], done: Callable[[Any], bool]) -> Any:
    return probes.poll_until(probe, done, timeout=REACTION_S, interval=0.5, error=lambda last: (
        TimeoutError(f"{what} not reached in {REACTION_S:.0f} s (last: {last!r})")))


def _per_gpu(prometheus: Prometheus, metric: str, node: str) -> dict[int, float]:
    return {int(s.labels["gpu"]): s.value
            for s in prometheus.query(f'{metric}{{node="{node}"}}')}


def _limits(prometheus: Prometheus, node: str) -> dict[int, float]:
    return _per_gpu(prometheus, "tessera_gpu_power_limit_watts", node)


def _targets(prometheus: Prometheus, node: str) -> dict[int, float]:
    return _per_gpu(prometheus, "tessera_gpu_power_target_watts", node)


def _power_table(prometheus: Prometheus, title: str) -> Table:
    table = Table(title=title)
    table.add_column("node")
    for gpu in range(8):
        table.add_column(f"GPU {gpu}", justify="right")
    for node in NODES:
        limits = _limits(prometheus, node)
        table.add_row(node, *(f"{limits.get(g, float('nan')):.0f} W" for g in range(8)))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=EXAMPLE, help="job manifest to apply")
    args = parser.parse_args(argv)
    console = Console()
    example = yaml.safe_load(args.job.read_text())
    job, namespace = example["metadata"]["name"], example["metadata"].get("namespace", "default")
    power = example["spec"]["powerPolicy"]

    # 1. a real kube-apiserver + etcd on loopback with the CRDs installed (reused if running)
    if up.main([]) != 0:
        return 1
    plane = launcher.ControlPlane.load(launcher.default_data_dir())
    if plane is None:
        console.print("[red]the control plane did not record its state[/]")
        return 1
    kubeconfig, work = plane.kubeconfig, plane.data_dir / "demo"
    work.mkdir(exist_ok=True)

    # 2. the shipped RBAC, and two simulated 8-GPU nodes that serve the job
    with plane.api_client() as admin:
        manifests.apply(admin, RBAC)
        simnodes.register(admin, NODES, job, namespace)
    console.print(f"simulated GPU nodes: {', '.join(NODES)}")

    with _components(plane, work, namespace, console) as prometheus:
        # 3. submit the example job the way a user does; the operator plans it
        applied = _kubectl(kubeconfig, "apply", "-f", str(args.job))
        _show(console, f"kubectl apply -f {args.job}", applied)
        if applied.returncode != 0:
            return 1
        _wait("the job Running at 8,8", lambda: _job_state(kubeconfig, job),
              lambda s: s == ("Running", "8,8"))
        _wait("base caps on every GPU", lambda: [_limits(prometheus, n) for n in NODES],
              lambda ls: all(set(lim.values()) == {power["baseCapWatts"]} and len(lim) == 8
                             for lim in ls))
        _show(console, "kubectl get ntpjob", _kubectl(kubeconfig, "get", "ntpjob", job))
        console.print(_power_table(prometheus, "GPU power limits (Prometheus), healthy"))

        # 4. a GPU fails: its replica continues at TP 7, the survivors are boosted
        _show(console, f"tessera cordon-gpu {NODES[0]} {FAILED_GPU}",
              _tessera("cordon-gpu", NODES[0], str(FAILED_GPU), "--kubeconfig", str(kubeconfig)))
        _wait("the job Degraded at 7,8", lambda: _job_state(kubeconfig, job),
              lambda s: s[0] == "Degraded" and sorted(s[1].split(",")) == ["7", "8"])
        _wait("survivors boosted to their targets (ramped)",
              lambda: (_limits(prometheus, NODES[0]), _targets(prometheus, NODES[0])),
              lambda lt: len(lt[0]) == 8 and lt[0] == lt[1]
              and min(w for g, w in lt[0].items() if g != FAILED_GPU) > power["baseCapWatts"])
        _show(console, "kubectl get ntpjob", _kubectl(kubeconfig, "get", "ntpjob", job))
        console.print(_power_table(prometheus, f"GPU power limits, GPU {FAILED_GPU} of "
                                               f"{NODES[0]} cordoned"))

        # 5. the GPU comes back: full TP, base caps
        _show(console, f"tessera uncordon-gpu {NODES[0]} {FAILED_GPU}",
              _tessera("uncordon-gpu", NODES[0], str(FAILED_GPU),
                       "--kubeconfig", str(kubeconfig)))
        _wait("the job Running at 8,8 again", lambda: _job_state(kubeconfig, job),
              lambda s: s == ("Running", "8,8"))
        _wait("base caps again", lambda: _limits(prometheus, NODES[0]),
              lambda lim: set(lim.values()) == {power["baseCapWatts"]})
        console.print(_power_table(prometheus, "GPU power limits, GPU back"))

    # 6. the API server itself rejects a bad spec, naming the field
    rejected = _kubectl(kubeconfig, "apply", "-f", "-", stdin=_invalid_variant(example))
    _show(console, "kubectl apply (boostCapWatts below baseCapWatts) -> rejected", rejected)
    if rejected.returncode == 0:
        console.print("[red]the invalid job was accepted[/]")
        return 1

    console.rule("next")
    console.print(f"export KUBECONFIG={kubeconfig}\n"
                  f"kubectl get ntpjob {job} -o yaml   # the job and its status\n"
                  f"kubectl get configmap {job}-layout -o yaml   # the layout document\n"
                  "kubectl get gpupowertargets -o yaml   # what the operator asked of the agents\n"
                  "tessera operator --kubeconfig $KUBECONFIG   # run the operator yourself\n"
                  "tessera simulate                  # NTP vs the alternatives at 32K GPUs\n"
                  "tessera down                      # stop the control plane", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
