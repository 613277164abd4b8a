"""`tessera demo`: the user's flow on one machine, against a real local control plane.

It drives the cluster the way a user would, with `kubectl` against the kubeconfig that
`tessera up` wrote, so what it shows is what a user can repeat by hand.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml
from rich.console import Console

from tessera_operator import paths
from tessera_operator.controlplane import launcher, up

EXAMPLE = paths.repo_root() / "manifests" / "examples" / "ntpjob-small.yaml"


def _kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", *args], input=stdin,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera demo", description=__doc__)
    parser.add_argument("--job", type=Path, default=EXAMPLE, help="job manifest to apply")
    args = parser.parse_args(argv)
    console = Console()

    # 1. a real kube-apiserver + etcd on loopback with the CRDs installed (reused if running)
    if up.main([]) != 0:
        return 1
    plane = launcher.ControlPlane.load(launcher.default_data_dir())
    if plane is None:
        console.print("[red]the control plane did not record its state[/]")
        return 1
    kubeconfig = plane.kubeconfig

    # 2. submit the example job the way a user does
    applied = _kubectl(kubeconfig, "apply", "-f", str(args.job))
    _show(console, f"kubectl apply -f {args.job}", applied)
    if applied.returncode != 0:
        return 1
    _show(console, "kubectl get ntpjob", _kubectl(kubeconfig, "get", "ntpjob"))

    # 3. the API server itself rejects a bad spec, naming the field
    example = yaml.safe_load(args.job.read_text())
    rejected = _kubectl(kubeconfig, "apply", "-f", "-", stdin=_invalid_variant(example))
    _show(console, "kubectl apply (boostCapWatts below baseCapWatts) -> rejected", rejected)
    if rejected.returncode == 0:
        console.print("[red]the invalid job was accepted[/]")
        return 1

    console.rule("next")
    console.print(f"export KUBECONFIG={kubeconfig}\n"
                  "kubectl get ntpjob -o yaml     # the job and its status\n"
                  "tessera simulate              # NTP vs the alternatives at 32K GPUs\n"
                  "tessera down                  # stop the control plane", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
