"""`tessera cordon-gpu NODE GPU` / `uncordon-gpu`: edit the node's cordoned-GPU annotation.

The annotation (`tessera.dev/cordoned-gpus: "3,5"`) is what the operator reads as the
administrative health signal; it can equally be written with `kubectl annotate`. Edits are merges
guarded by the node's resourceVersion, so a concurrent edit is retried, never overwritten, and
running the command twice changes nothing the second time. The command returns once the
annotation is written: the operator's replanning follows on its own, and is not waited for.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from tessera_cli import kube
from tessera_contracts.api import CORDON_ANNOTATION
from tessera_contracts.cordon import format_indices, parse_indices
from tessera_contracts.powertarget import MAX_GPUS_PER_NODE

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

GPU_RESOURCE = "nvidia.com/gpu"
ATTEMPTS = 3


class CordonError(Exception):
    """The edit cannot be made; the message says why and what to do."""


def gpu_count(node: dict[str, Any]) -> int | None:
    """The node's GPU capacity, or None when it reports none (or not as a plain count)."""
    capacity = (node.get("status") or {}).get("capacity") or {}
    value = str(capacity.get(GPU_RESOURCE, ""))
    return int(value) if value.isascii() and value.isdigit() and len(value) < 4 else None


def edit(api: ApiClient, node: str, gpu: int, *, cordon: bool) -> tuple[str, str]:
    """Add (cordon) or remove `gpu` in the node's annotation; returns (before, after) values."""
    path = f"/api/v1/nodes/{node}"
    for _ in range(ATTEMPTS):
        try:
            current = kube.request(api, "GET", path)
        except kube.ApiError as exc:
            if exc.status == 404:
                raise CordonError(f"node {node!r} does not exist") from exc
            raise
        count = gpu_count(current)
        if count is not None and gpu >= count:
            raise CordonError(f"node {node} has {count} GPUs (0-{count - 1}); no GPU {gpu}")
        if gpu >= MAX_GPUS_PER_NODE:
            # Without a capacity to check against, the agent's own bound keeps the annotation
            # readable: what this command writes, it can always read back.
            raise CordonError(f"node {node} reports no {GPU_RESOURCE} capacity and no node has "
                              f"more than {MAX_GPUS_PER_NODE} GPUs; no GPU {gpu}")
        meta = current.get("metadata") or {}
        before = (meta.get("annotations") or {}).get(CORDON_ANNOTATION, "")
        indices, problems = parse_indices(before, MAX_GPUS_PER_NODE)
        if problems:
            raise CordonError(
                f"node {node}: {CORDON_ANNOTATION}={before!r} is malformed ({'; '.join(problems)});"
                f" fix it with `kubectl annotate --overwrite node {node} {CORDON_ANNOTATION}=...`")
        after = format_indices(indices | {gpu} if cordon else indices - {gpu})
        if after == before:
            return before, after
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion"),
                              "annotations": {CORDON_ANNOTATION: after or None}}}
        try:
            kube.request(api, "PATCH", path, patch, "application/merge-patch+json")
            return before, after
        except kube.ApiError as exc:
            if exc.status != 409:  # 409: the node changed since we read it; read it again
                raise
    raise CordonError(f"node {node} kept changing; {ATTEMPTS} attempts conflicted")


def run(argv: list[str], *, cordon: bool, prog: str | None = None) -> int:
    verb = "cordon" if cordon else "uncordon"
    prog = prog or f"tessera {verb}-gpu"
    p = argparse.ArgumentParser(
        prog=prog,
        description=f"{verb.capitalize()} one GPU of a node for Tessera's planner "
                    f"(annotation {CORDON_ANNOTATION}). Returns once the annotation is "
                    "written; the operator replans on its own.")
    p.add_argument("node")
    p.add_argument("gpu", type=int, help="GPU index on the node (as nvidia-smi numbers it)")
    kube.add_arguments(p)
    args = p.parse_args(argv)
    if args.gpu < 0:
        p.error(f"GPU index must be >= 0, got {args.gpu}")
    kube.check_arguments(p, args)
    try:
        with kube.connect(args.kubeconfig, args.context) as api:
            before, after = edit(api, args.node, args.gpu, cordon=cordon)
    except (CordonError, kube.KubeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    if before == after:
        state = "already cordoned" if cordon else "not cordoned"
        print(f"node {args.node}: GPU {args.gpu} {state}; nothing changed")
    else:
        print(f"node {args.node}: {verb}ed GPU {args.gpu} "
              f"({CORDON_ANNOTATION}: {before!r} -> {after!r}); the operator replans on its own")
    return 0


def main(argv: list[str]) -> int:
    return run(argv, cordon=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
