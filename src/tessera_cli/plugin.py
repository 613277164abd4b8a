"""`kubectl ntp`: the kubectl plugin (the console script `kubectl-ntp`, found on PATH by kubectl).

`kubectl ntp status JOB` shows a job's layout, its GPUs' cordon, health and power, its step and
goodput; `kubectl ntp cordon NODE GPU` / `uncordon` are `tessera cordon-gpu` / `uncordon-gpu`.
kubectl hands the plugin its arguments unchanged, so `--context`, `--kubeconfig` and `-n` are
read here, as kubectl reads them.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from tessera_cli import cordon, kube
from tessera_cli.jobstatus import JobObjects, job_nodes, render
from tessera_cli.main import COMMANDS as TESSERA_COMMANDS
from tessera_cli.main import Commands, dispatch
from tessera_contracts.api import (
    API_VERSION,
    GPU_HEALTH_KIND,
    GPU_HEALTH_PLURAL,
    JOB_KIND,
    JOB_PLURAL,
    POWER_TARGET_KIND,
    POWER_TARGET_PLURAL,
)
from tessera_contracts.generation import layout_configmap
from tessera_contracts.progress import progress_configmap

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

PROG = "kubectl ntp"
COMMANDS: Commands = {
    "status": ("tessera_cli.plugin:status",
               "a job's phase, layout, step, goodput, and its GPUs' cordon, health and power"),
    "cordon": ("tessera_cli.plugin:cordon_gpu", TESSERA_COMMANDS["cordon-gpu"][1]),
    "uncordon": ("tessera_cli.plugin:uncordon_gpu", TESSERA_COMMANDS["uncordon-gpu"][1]),
}


def _get(api: ApiClient, path: str, kind: str | None = None,
         forbidden: set[str] | None = None) -> dict[str, Any] | None:
    """The object at `path`, None if it does not exist. With `kind`, also None when the user may
    not read it, `kind` then added to `forbidden`: the status shows what it can."""
    try:
        return kube.request(api, "GET", path)
    except kube.ApiError as exc:
        if exc.status == 404:
            return None
        if exc.status == 403 and kind is not None and forbidden is not None:
            forbidden.add(kind)
            return None
        raise


def read(api: ApiClient, namespace: str, job: str) -> JobObjects:
    """The job and every object its status shows; KubeError if the job does not exist or may
    not be read. The user's roles may grant the job and its ConfigMaps (`view` in its namespace)
    and not the cluster-scoped Nodes, GPUPowerTargets and GPUHealths: those are then named in
    `forbidden`."""
    ns = quote(namespace, safe="")
    found = _get(api, f"/apis/{API_VERSION}/namespaces/{ns}/{JOB_PLURAL}/{quote(job, safe='')}")
    if found is None:
        raise kube.KubeError(f"no {JOB_KIND} {job!r} in namespace {namespace!r}")
    configmaps = f"/api/v1/namespaces/{ns}/configmaps"
    nodes = [quote(n, safe="") for n in job_nodes(found)]
    forbidden: set[str] = set()
    return JobObjects(
        job=found,
        layout=_get(api, f"{configmaps}/{quote(layout_configmap(job), safe='')}",
                    "ConfigMaps", forbidden),
        progress=_get(api, f"{configmaps}/{quote(progress_configmap(job), safe='')}",
                      "ConfigMaps", forbidden),
        nodes={n: _get(api, f"/api/v1/nodes/{n}", "Nodes", forbidden) for n in nodes},
        targets={n: _get(api, f"/apis/{API_VERSION}/{POWER_TARGET_PLURAL}/{n}",
                         POWER_TARGET_KIND + "s", forbidden) for n in nodes},
        health={n: _get(api, f"/apis/{API_VERSION}/{GPU_HEALTH_PLURAL}/{n}",
                        GPU_HEALTH_KIND + "s", forbidden) for n in nodes},
        forbidden=frozenset(forbidden),
    )


def status(argv: list[str]) -> int:
    prog = f"{PROG} status"
    p = argparse.ArgumentParser(prog=prog, description=COMMANDS["status"][1].capitalize() + ".")
    p.add_argument("job", help="the NTPTrainingJob's name")
    p.add_argument("-n", "--namespace",
                   help="its namespace (default: the context's namespace, else default)")
    kube.add_arguments(p)
    args = p.parse_args(argv)
    kube.check_arguments(p, args)
    try:
        with kube.connect(args.kubeconfig, args.context) as api:
            namespace = args.namespace or kube.default_namespace(args.kubeconfig, args.context)
            objects = read(api, namespace, args.job)
    except kube.KubeError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(render(objects, time.time()), end="")
    return 0


def cordon_gpu(argv: list[str]) -> int:
    return cordon.run(argv, cordon=True, prog=f"{PROG} cordon")


def uncordon_gpu(argv: list[str]) -> int:
    return cordon.run(argv, cordon=False, prog=f"{PROG} uncordon")


def main(argv: list[str] | None = None) -> int:
    return dispatch(PROG, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
