"""What the watches last delivered, kept where kopf's indices cannot serve.

kopf's indices (`handlers`) hold what the operator reads of pods, GPUHealth, children and jobs.
Two needs are beyond them, and kept here:

- `NodeCache`, the nodes' facts that placement and health read (a few small values per node,
  never the node's body), ordered by resourceVersion. A job
  placed on a node the watch has not delivered yet (just created, or the operator just started)
  reads it from the API; the watch may then deliver the node's creation, older than that read.
  A kopf index takes every event as it comes and cannot be written by an API read, so planning
  on it would step back to a state the node has left (a cordon read, then taken back by the
  node's creation event: layouts and power targets that flap). Here the read is kept with its
  resourceVersion and older events are skipped.
- `LastSeen`, what a watch predicate compares. kopf's event handlers get only the new object
  (its change handlers, which get the old one too, keep it in an annotation on the object: a
  write to every pod and node per change, which the operator may not make), so whether an event
  changed what a job reads (a pod's phase or address, a GPU's state) needs the facts the last
  event had.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

from tessera_contracts.api import CORDON_ANNOTATION
from tessera_operator import health
from tessera_operator.workload import GPU_RESOURCE


class NodeFacts(NamedTuple):
    """What placement and health read of a node."""

    labels: dict[str, str]
    cordon: str | None  # the cordon annotation's value
    gpus: str | None  # allocatable nvidia.com/gpu
    unschedulable: bool
    lost: bool  # it stopped reporting (`health.node_lost`)

    @classmethod
    def of(cls, node: Mapping[str, Any]) -> NodeFacts:
        """The facts of a node as a watch event or an API read has it."""
        meta = node["metadata"]
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        # Interned: thousands of nodes share their label keys and most values.
        return cls({sys.intern(k): sys.intern(v) for k, v in (meta.get("labels") or {}).items()},
                   (meta.get("annotations") or {}).get(CORDON_ANNOTATION),
                   allocatable.get(GPU_RESOURCE),
                   bool((node.get("spec") or {}).get("unschedulable")), health.node_lost(node))

    def node(self, name: str) -> dict[str, Any]:
        """The node as the pure modules read it: a Node object holding these facts only."""
        ready = {"type": "Ready", "status": "Unknown", "reason": health.NODE_LOST_REASON}
        return {"metadata": {"name": name, "labels": self.labels,
                             "annotations": {} if self.cordon is None else {
                                 CORDON_ANNOTATION: self.cordon}},
                "spec": {"unschedulable": self.unschedulable},
                "status": {"allocatable": {} if self.gpus is None else {GPU_RESOURCE: self.gpus},
                           "conditions": [ready] if self.lost else []}}


def _version(obj: Mapping[str, Any]) -> int | None:
    """The object's resourceVersion as a number, to tell a watch event older than an API read.
    The API server's are etcd revisions, which only grow; one that is not a number (another
    storage) is not compared, and the event is taken as it comes."""
    found = obj["metadata"].get("resourceVersion")
    return int(found) if isinstance(found, str) and found.isdecimal() else None


class NodeCache:
    """Every node's facts as the node watch last delivered them, or as an API read found them
    when that is newer. Thread-safe: the watch runs on kopf's event loop, reconciles in
    threads."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._nodes: dict[str, tuple[int | None, NodeFacts]] = {}
        self.changes = 0  # events that changed what planning reads, so far

    def deliver(self, name: str, node: Mapping[str, Any] | None) -> bool:
        """A watch event of the node (`node` None: it was deleted); True when what planning
        reads of it changed, False too when the event is older than what a read found."""
        seen = None if node is None else NodeFacts.of(node)
        found = None if node is None else _version(node)
        with self._guard:
            before_version, before = self._nodes.get(name, (None, None))
            if found is not None and before_version is not None and found < before_version:
                return False
            self._nodes.pop(name, None)
            if seen is not None:
                self._nodes[name] = (found, seen)
            changed = seen != before
            self.changes += changed
        return changed

    def matching(self, selector: Mapping[str, str]) -> list[tuple[str, NodeFacts]]:
        """The nodes whose labels hold `selector`, by name."""
        with self._guard:
            found = [(name, facts) for name, (_, facts) in self._nodes.items()
                     if all(facts.labels.get(k) == v for k, v in selector.items())]
        return sorted(found, key=lambda found: found[0])

    def get(self, name: str) -> NodeFacts | None:
        with self._guard:
            return self._nodes.get(name, (None, None))[1]

    def offer(self, node: Mapping[str, Any]) -> NodeFacts:
        """An API read of a node the watch had not delivered: kept, unless an event of it came
        meanwhile (that one is newer); returns the facts kept."""
        name = node["metadata"]["name"]
        with self._guard:
            return self._nodes.setdefault(name, (_version(node), NodeFacts.of(node)))[1]


class LastSeen:
    """Per object, the facts its last watch event had, for predicates that fire on a change."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._seen: dict[Hashable, object] = {}

    def changed(self, key: Hashable, facts: object | None) -> bool:
        """Record `facts` for `key` (None: the object was deleted); True when they differ from
        the last recorded."""
        with self._guard:
            before = self._seen.pop(key, None)
            if facts is not None:
                self._seen[key] = facts
        return facts != before
