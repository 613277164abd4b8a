"""`tessera uninstall`: delete every NTPTrainingJob and wait until they are gone, before the
operator that finishes them is removed.

An NTPTrainingJob carries the operator's finalizer until the operator has stopped its pods and
settled its GPUs' power. Removed with its jobs still present, the operator can no longer take its
finalizer off them: they, and with them their CustomResourceDefinition, stay stuck terminating.
The chart runs this command as its pre-delete hook, while the operator still runs; with the
kustomize bundle run it (or `kubectl delete ntptrainingjobs --all -A --wait`) before deleting
the bundle. It deletes every job in every namespace: uninstalling Tessera ends all training.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tessera_cli import kube
from tessera_contracts.api import API_VERSION, JOB_PLURAL

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

JOBS = f"/apis/{API_VERSION}/{JOB_PLURAL}"
POLL_S = 2.0


class UninstallError(Exception):
    """The jobs could not all be removed; the message says which are left."""


def remaining(api: ApiClient) -> list[str]:
    """`namespace/name` of every NTPTrainingJob; none when the CRD itself is gone."""
    try:
        listed = kube.request(api, "GET", JOBS)
    except kube.ApiError as exc:
        if exc.status == 404:
            return []
        raise
    return sorted(f"{j['metadata']['namespace']}/{j['metadata']['name']}"
                  for j in listed.get("items") or [])


def delete_all(api: ApiClient, timeout: float, log=print) -> int:
    """Delete every job and wait until none is left; returns how many there were."""
    jobs = remaining(api)
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
                f"{len(left)} NTPTrainingJob(s) still present after {timeout:.0f} s: "
                f"{', '.join(left)}; the operator removes their finalizer: is it running? "
                "(`kubectl -n <install namespace> logs deploy/tessera-operator`)")
        time.sleep(POLL_S)
        left = remaining(api)
    return len(jobs)


@contextmanager
def connect(args: argparse.Namespace) -> Iterator[ApiClient]:
    """The pod's service account when run in a pod with no kubeconfig given (the chart's hook),
    else the kubeconfig, as kubectl chooses."""
    in_pod = "KUBERNETES_SERVICE_HOST" in os.environ and "KUBECONFIG" not in os.environ
    if args.kubeconfig is None and args.context is None and in_pod:
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        with client.ApiClient(configuration) as api:
            yield api
    else:
        with kube.connect(args.kubeconfig, args.context) as api:
            yield api


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
        with connect(args) as api:
            count = delete_all(api, args.timeout)
    except (UninstallError, kube.KubeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(f"{count} NTPTrainingJob(s) deleted; none left" if count else "no NTPTrainingJob left")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
