"""`tessera cordon-gpu NODE GPU` / `uncordon-gpu`: edit the node's cordoned-GPU annotation.

The annotation (`tessera.dev/cordoned-gpus: "3,5"`) is what the operator reads as the
administrative health signal; it can equally be written with `kubectl annotate`. Edits are merges
guarded by the node's resourceVersion, so a concurrent edit is retried, never overwritten, and
running the command twice changes nothing the second time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tessera_contracts.api import CORDON_ANNOTATION
from tessera_contracts.cordon import format_indices, parse_indices
from tessera_contracts.powertarget import MAX_GPUS_PER_NODE

GPU_RESOURCE = "nvidia.com/gpu"
ATTEMPTS = 3
TIMEOUT_S = 10.0


class CordonError(Exception):
    """The edit cannot be made; the message says why and what to do."""


def _gpu_count(node: client.V1Node) -> int | None:
    """The node's GPU capacity, or None when it reports none (or not as a plain count)."""
    capacity = (node.status.capacity if node.status else None) or {}
    value = str(capacity.get(GPU_RESOURCE, ""))
    return int(value) if value.isascii() and value.isdigit() and len(value) < 4 else None


def edit(api: client.ApiClient, node: str, gpu: int, *, cordon: bool) -> tuple[str, str]:
    """Add (cordon) or remove `gpu` in the node's annotation; returns (before, after) values."""
    core = client.CoreV1Api(api)
    for _ in range(ATTEMPTS):
        try:
            current = core.read_node(node, _request_timeout=TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                raise CordonError(f"node {node!r} does not exist") from exc
            raise
        count = _gpu_count(current)
        if count is not None and gpu >= count:
            raise CordonError(f"node {node} has {count} GPUs (0-{count - 1}); no GPU {gpu}")
        if gpu >= MAX_GPUS_PER_NODE:
            # Without a capacity to check against, the agent's own bound keeps the annotation
            # readable: what this command writes, it can always read back.
            raise CordonError(f"node {node} reports no {GPU_RESOURCE} capacity and no node has "
                              f"more than {MAX_GPUS_PER_NODE} GPUs; no GPU {gpu}")
        before = (current.metadata.annotations or {}).get(CORDON_ANNOTATION, "")
        indices, problems = parse_indices(before, MAX_GPUS_PER_NODE)
        if problems:
            raise CordonError(
                f"node {node}: {CORDON_ANNOTATION}={before!r} is malformed ({'; '.join(problems)});"
                f" fix it with `kubectl annotate --overwrite node {node} {CORDON_ANNOTATION}=...`")
        after = format_indices(indices | {gpu} if cordon else indices - {gpu})
        if after == before:
            return before, after
        patch = {"metadata": {"resourceVersion": current.metadata.resource_version,
                              "annotations": {CORDON_ANNOTATION: after or None}}}
        try:
            core.patch_node(node, patch, _request_timeout=TIMEOUT_S)
            return before, after
        except ApiException as exc:
            if exc.status != 409:  # 409: the node changed since we read it; read it again
                raise
    raise CordonError(f"node {node} kept changing; {ATTEMPTS} attempts conflicted")


def run(argv: list[str], *, cordon: bool) -> int:
    verb = "cordon" if cordon else "uncordon"
    p = argparse.ArgumentParser(
        prog=f"tessera {verb}-gpu",
        description=f"{verb.capitalize()} one GPU of a node for Tessera's planner "
                    f"(annotation {CORDON_ANNOTATION}).")
    p.add_argument("node")
    p.add_argument("gpu", type=int, help="GPU index on the node (as nvidia-smi numbers it)")
    p.add_argument("--kubeconfig", type=Path, help="kubeconfig (default: $KUBECONFIG)")
    args = p.parse_args(argv)
    if args.gpu < 0:
        p.error(f"GPU index must be >= 0, got {args.gpu}")
    if args.kubeconfig is not None and not args.kubeconfig.is_file():
        p.error(f"no kubeconfig at {args.kubeconfig}")
    try:
        with config.new_client_from_config(
            config_file=str(args.kubeconfig) if args.kubeconfig else None
        ) as api:
            before, after = edit(api, args.node, args.gpu, cordon=cordon)
    except CordonError as exc:
        print(f"tessera {verb}-gpu: {exc}", file=sys.stderr)
        return 1
    except config.ConfigException as exc:
        print(f"tessera {verb}-gpu: {exc} (pass --kubeconfig or set $KUBECONFIG)",
              file=sys.stderr)
        return 1
    except ApiException as exc:
        print(f"tessera {verb}-gpu: API server answered {exc.status}: {exc.reason}",
              file=sys.stderr)
        return 1
    except HTTPError as exc:
        print(f"tessera {verb}-gpu: API server unreachable: {exc}", file=sys.stderr)
        return 1
    if before == after:
        state = "already cordoned" if cordon else "not cordoned"
        print(f"node {args.node}: GPU {args.gpu} {state}; nothing changed")
    else:
        print(f"node {args.node}: {verb}ed GPU {args.gpu} "
              f"({CORDON_ANNOTATION}: {before!r} -> {after!r})")
    return 0


def main(argv: list[str]) -> int:
    return run(argv, cordon=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
