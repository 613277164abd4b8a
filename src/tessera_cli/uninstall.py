"""`tessera uninstall`: make sure no NTPTrainingJob is left, then stop the operator, before the
operator and the agents are removed.

Users' jobs are never deleted unasked: while any NTPTrainingJob that nobody is deleting exists it
fails, naming them, and changes nothing. With `--delete-jobs` it deletes every one of them in
every namespace (their training ends). Either way it then waits until every job is gone (those
their owners are deleting too), the operator has released their GPUs' power targets and the
power agents have settled every GPU of the nodes the jobs used at the base cap inside the node's
last budget share.

A job's pods go with it (they are its children), but its GPUPowerTargets are cluster-scoped and
released by the operator when it sees the deletion: a job deleted after the operator leaves its
GPUs' power where it was planned. Jobs that an older operator marked with its finalizer would
stay stuck terminating, and their CustomResourceDefinition with them. Once a node's target is
gone its agent settles its GPUs (a GPU cordoned at its minimum or boosted included), and says so
on its metrics page (`tessera_cli.settled`): those limits are where the GPUs stay once the agents
are gone (docs/install.md says how to give them back their device defaults). Last it stops the
operator (no replica), whose leader deletes its leader-election Lease on the way out, while its
RBAC still lets it. The chart runs this command as its pre-delete hook (`--delete-jobs` when the
value `uninstall.deleteJobs` says so), while the operator and the agents still run; with the
kustomize bundle run it before deleting the bundle.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tessera_cli import kube, settled
from tessera_contracts.api import (
    API_VERSION,
    JOB_PLURAL,
    JOB_UID_LABEL,
    OPERATOR_NAME,
    POWER_TARGET_PLURAL,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

JOBS = f"/apis/{API_VERSION}/{JOB_PLURAL}"
JOB_TARGETS = f"/apis/{API_VERSION}/{POWER_TARGET_PLURAL}?labelSelector={JOB_UID_LABEL}"
POLL_S = 2.0
DEFAULT_NAMESPACE = "tessera-system"


class UninstallError(Exception):
    """The jobs could not all be removed, or their GPUs settled; the message says what is left."""


class JobsLeft(UninstallError):
    """NTPTrainingJobs exist and deleting them was not asked for."""


def _items(api: ApiClient, path: str) -> list[dict]:
    """The objects listed at `path`; none when their CRD itself is gone."""
    try:
        return kube.request(api, "GET", path).get("items") or []
    except kube.ApiError as exc:
        if exc.status == 404:
            return []
        raise


def _jobs(api: ApiClient, *, deleting: bool = True) -> list[str]:
    """Every job, as NAMESPACE/NAME; without `deleting`, only those nobody is deleting yet."""
    return sorted(f"{j['metadata']['namespace']}/{j['metadata']['name']}"
                  for j in _items(api, JOBS)
                  if deleting or not j["metadata"].get("deletionTimestamp"))


def _job_targets(api: ApiClient) -> list[str]:
    """The nodes of the power targets the operator holds for a job (a target is named after its
    node)."""
    return sorted(t["metadata"]["name"] for t in _items(api, JOB_TARGETS))


def _wait(what: Callable[[], list[str]], deadline: float) -> list[str]:
    """Poll `what` (what is left, one line each) until nothing is or `deadline` (monotonic) has
    passed; what is left then."""
    left = what()
    while left and time.monotonic() <= deadline:
        time.sleep(POLL_S)
        left = what()
    return left


def delete_all(api: ApiClient, timeout: float, namespace: str = DEFAULT_NAMESPACE,
               log: Callable[[str], object] = print, *, delete_jobs: bool = False) -> int:
    """With `delete_jobs`, delete every job; then wait, `timeout` seconds in all, until no job
    (those being deleted by others included) and no job's power target is left, then until the
    power agents (in `namespace`) report every node those targets named settled; UninstallError
    naming what is left when the time is up. Without `delete_jobs`, JobsLeft naming the jobs
    nobody is deleting, if there is any, before anything is changed. Then stop the operator.
    Returns how many jobs there were."""
    deadline = time.monotonic() + timeout
    # 1. the users' jobs: deleted only when asked
    kept = _jobs(api, deleting=False)
    if kept and not delete_jobs:
        raise JobsLeft(
            f"{len(kept)} NTPTrainingJob(s) exist, left as they are: {', '.join(kept)}; delete "
            "them first (their training ends) and run the uninstall again, or let it delete "
            "them (`tessera uninstall --delete-jobs`; the chart's value uninstall.deleteJobs, "
            "set before `helm uninstall`: docs/install.md, Uninstalling)")
    jobs = _jobs(api)
    # 2. the nodes whose GPUs the jobs' targets set, before the operator releases them
    nodes = set(_job_targets(api))
    # 3. the jobs, while the operator runs
    for job in jobs:
        ns, name = job.split("/")
        try:
            kube.request(api, "DELETE", f"/apis/{API_VERSION}/namespaces/{ns}/{JOB_PLURAL}/{name}")
        except kube.ApiError as exc:
            if exc.status != 404:  # 404: gone since the list
                raise
        log(f"deleting NTPTrainingJob {job}")

    # 4. the operator finishes them and releases their power targets
    def jobs_and_targets() -> list[str]:
        targets = _job_targets(api)
        nodes.update(targets)
        return _jobs(api) + [f"GPUPowerTarget {node}" for node in targets]

    left = _wait(jobs_and_targets, deadline)
    if left:
        raise UninstallError(
            f"still present after {timeout:.0f} s: {', '.join(left)}; the operator finishes "
            "jobs and releases their power targets: is it running? "
            "(`kubectl -n <install namespace> logs deploy/tessera-operator`)")
    # 5. each of those nodes' agents settles its GPUs at the base cap once released
    if nodes:
        log(f"waiting for the power agents to settle the GPUs of {', '.join(sorted(nodes))}")
    left = _wait(lambda: [f"node {node}: {what}" for node, what in
                          settled.unsettled(api, namespace, nodes).items()], deadline)
    if left:
        raise UninstallError(
            f"the jobs are gone, but their GPUs are not settled after {timeout:.0f} s: "
            f"{'; '.join(left)}; the power agents, still installed, keep each node inside its "
            "budget share: run it again once they can settle, or remove Tessera all the same "
            "(`helm uninstall --no-hooks`: each agent settles its node as it exits, one that "
            "cannot leaves its GPUs where they are; docs/install.md, Uninstalling)")
    # 6. the operator stops while it may still delete its Lease (removing the install deletes
    # its RBAC at the same time as its pods, and a leader stopping after that could not)
    left = stop_operator(api, namespace, deadline)
    if left:
        log(f"warning: the operator's pods {', '.join(left)} still run after {timeout:.0f} s; "
            f"its Lease {namespace}/{OPERATOR_NAME} may stay: delete it once they are gone")
    return len(jobs)


def stop_operator(api: ApiClient, namespace: str, deadline: float) -> list[str]:
    """Scale the operator to no replica, wait (until `deadline`) for its pods to be gone (its
    leader deletes the Lease as it stops), and delete the Lease if one is left (a leader that
    crashed); the pods still there at the deadline, whose Lease is then left alone."""
    try:
        kube.request(api, "PATCH", f"/apis/apps/v1/namespaces/{namespace}/deployments/"
                                   f"{OPERATOR_NAME}/scale", {"spec": {"replicas": 0}},
                     content_type="application/merge-patch+json")
    except kube.ApiError as exc:
        if exc.status != 404:  # 404: no operator (installed otherwise, or removed already)
            raise
    pods = (f"/api/v1/namespaces/{namespace}/pods?labelSelector="
            f"app.kubernetes.io/name={OPERATOR_NAME}")
    left = _wait(lambda: sorted(p["metadata"]["name"] for p in _items(api, pods)), deadline)
    if not left:
        try:
            kube.request(api, "DELETE", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/"
                                        f"leases/{OPERATOR_NAME}")
        except kube.ApiError as exc:
            if exc.status != 404:  # 404: deleted by its leader as it stopped
                raise
    return left


def main(argv: list[str]) -> int:
    prog = "tessera uninstall"
    p = argparse.ArgumentParser(
        prog=prog, description="Run before removing Tessera: refuse while any NTPTrainingJob "
        "exists (or, with --delete-jobs, delete every one in every namespace and wait until the "
        "operator has finished them and the power agents have settled their nodes' GPUs at the "
        "base cap), then stop the operator.")
    p.add_argument("--delete-jobs", action="store_true",
                   help="delete every NTPTrainingJob in every namespace (their training ends) "
                        "instead of refusing while any exists")
    p.add_argument("--timeout", type=float, default=240.0,
                   help="seconds to wait for the jobs to be gone and their GPUs settled, in all "
                        "(default 240)")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                   help="the install's namespace, where the power agents run (default "
                        f"{DEFAULT_NAMESPACE})")
    kube.add_arguments(p)
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    kube.check_arguments(p, args)
    try:
        with kube.connect(args.kubeconfig, args.context) as api:
            count = delete_all(api, args.timeout, args.namespace, delete_jobs=args.delete_jobs)
    except (UninstallError, kube.KubeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(f"{count} NTPTrainingJob(s) deleted, their GPUs settled; none left" if count
          else "no NTPTrainingJob left")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
