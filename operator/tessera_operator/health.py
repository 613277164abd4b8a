"""GPU health from observed Node objects: the set of (node, GPU index) the planner must not use.

Pure: it reads Node objects as the API returns them (plain dicts) and never raises on what a
person typed into an annotation; a value it cannot use is ignored and reported with the reason.
Every source (the administrative cordon today, DCGM later) produces a `Health`, and `merge`
combines them, so the planner sees one shape whatever the signal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

CORDON_ANNOTATION = "tessera.dev/cordoned-gpus"

GpuId = tuple[str, int]


@dataclass(frozen=True)
class Health:
    """Failed GPUs, and why some input was ignored (one human-readable line each)."""

    failed: frozenset[GpuId] = frozenset()
    problems: tuple[str, ...] = ()

    def merge(self, other: Health) -> Health:
        return Health(self.failed | other.failed, self.problems + other.problems)


def parse_indices(value: str, gpus: int) -> tuple[frozenset[int], tuple[str, ...]]:
    """GPU indices from a comma-separated annotation value such as "3" or "1, 5".

    Each item that is not an integer in [0, gpus) is skipped and described in the problems.
    """
    indices: set[int] = set()
    problems: list[str] = []
    for item in value.split(","):
        token = item.strip()
        if not token:
            continue
        if not token.isdecimal():
            problems.append(f"{token!r} is not a GPU index")
        elif int(token) >= gpus:
            problems.append(f"GPU {token} does not exist (the node has GPUs 0-{gpus - 1})")
        else:
            indices.add(int(token))
    return frozenset(indices), tuple(problems)


def format_indices(indices: Iterable[int]) -> str:
    """The annotation value for a set of indices: sorted, comma-separated, no spaces."""
    return ",".join(str(i) for i in sorted(set(indices)))


def from_cordons(nodes: Iterable[Mapping[str, Any]], gpus_per_node: int) -> Health:
    """GPUs an administrator cordoned through the node annotation."""
    failed: set[GpuId] = set()
    problems: list[str] = []
    for node in nodes:
        name = node["metadata"]["name"]
        annotations = node["metadata"].get("annotations") or {}
        value = annotations.get(CORDON_ANNOTATION)
        if value is None:
            continue
        indices, bad = parse_indices(str(value), gpus_per_node)
        failed.update((name, i) for i in indices)
        problems.extend(f"node {name}: {CORDON_ANNOTATION}: {why}, ignored" for why in bad)
    return Health(frozenset(failed), tuple(problems))
