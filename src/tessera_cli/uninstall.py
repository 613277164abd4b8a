"""`tessera uninstall`: delete every NTPTrainingJob and wait until they are gone and the
operator has released their GPUs' power targets, before the operator is removed.

A job's pods go with it (they are its children), but its GPUPowerTargets are cluster-scoped and
released by the operator when it sees the deletion: a job deleted after the operator leaves its
GPUs' power where it was planned. Jobs that an older operator marked with its finalizer would
stay stuck terminating, and their CustomResourceDefinition with them. The chart runs this
command as its pre-delete hook, while the operator still runs; with the kustomize bundle run it
before deleting the bundle. It deletes every job in every namespace: uninstalling Tessera ends
all training.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from tessera_cli import kube
from tessera_contracts.api import API_VERSION, JOB_PLURAL, JOB_UID_LABEL, POWER_TARGET_PLURAL

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

JOBS = f"/apis/{API_VERSION}/{JOB_PLURAL}"
JOB_TARGETS = f"/apis/{API_VERSION}/{POWER_TARGET_PLURAL}?labelSelector={JOB_UID_LABEL}"
POLL_S = 2.0


class UninstallError(Exception):
    """The jobs could not all be removed; the message says which are left."""


def _items(api: ApiClient, path: str) -> list[dict]:
    """The objects listed at `path`; none when their CRD itself is gone."""
    try:
        return kube.request(api, "GET", path).get("items") or []
    except kube.ApiError as exc:
        if exc.status == 404:
            return []
        raise


def _jobs(api: ApiClient) -> list[str]:
    return sorted(f"{j['metadata']['namespace']}/{j['metadata']['name']}"
                  for j in _items(api, JOBS))


def remaining(api: ApiClient) -> list[str]:
    """`namespace/name` of every NTPTrainingJob, then `GPUPowerTarget NODE` of every power target
    the operator holds for a job."""
    return _jobs(api) + sorted(f"GPUPowerTarget {t['metadata']['name']}"
                               for t in _items(api, JOB_TARGETS))


def delete_all(api: ApiClient, timeout: float, log=print) -> int:
    """Delete every job and wait until no job and no job's power target is left; returns how
    many jobs there were."""
    jobs = _jobs(api)
    for job in jobs:
        namespace, name = job.split("/")
        try:
            kube.request(api, "DELETE", f"/apis/{API_VERSION}/namespaces/{namespace}/"
                                        f"{JOB_PLURAL}/{name}")
        except kube.ApiError as exc:
            if exc.status != 404:  # 404: gone since the list
                raise
        log(f"deleting NTPTrainingJob {job}")
    deadline = time.monotonic() + timeout
    left = remaining(api)
    while left:
        if time.monotonic() > deadline:
            raise UninstallError(
                f"still present after {timeout:.0f} s: {', '.join(left)}; the operator "
                "finishes jobs and releases their power targets: is it running? "
                "(`kubectl -n <install namespace> logs deploy/tessera-operator`)")
        time.sleep(POLL_S)
        left = remaining(api)
    return len(jobs)


def main(argv: list[str]) -> int:
    prog = "tessera uninstall"
    p = argparse.ArgumentParser(
        prog=prog, description="Delete every NTPTrainingJob in every namespace and wait until "
        "the operator has finished them: run before removing Tessera.")
    p.add_argument("--timeout", type=float, default=240.0,
                   help="seconds to wait for the jobs to be gone (default 240)")
    kube.add_arguments(p)
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    kube.check_arguments(p, args)
    try:
        with kube.connect(args.kubeconfig, args.context) as api:
            count = delete_all(api, args.timeout)
    except (UninstallError, kube.KubeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(f"{count} NTPTrainingJob(s) deleted; none left" if count else "no NTPTrainingJob left")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
