"""The node agents' heartbeats on the job's store: a node whose agent froze or vanished whole
(agent and ranks with it, so that nobody is left to report a death) is known to the job in
seconds, not after the node controller's grace period or a collective's timeout.

Every agent adds 1 to its counter (`beat_key`) every `beat_s`, from its main loop: a frozen or
hung agent stops beating, whatever its threads do. Each agent watches the next `WATCHED` agents
after its own node in the sorted nodes of the generation in force (a ring: every node is
watched by `WATCHED` others, and each agent reads that many counters a beat, whatever the job's
size). It compares counters, never timestamps, on its own clock: a node whose counter has not
moved for over `timeout_s` is silent, unless its agent said it is done (`done_key`: the job
finished and it is leaving). A node is judged only once its watcher has seen it beat since it
began watching it (a node whose agent does not run yet, say a pod starting, is its kubelet's
to tell of). An observer that itself went without a beat for over `timeout_s` (a machine too
loaded to run it) starts every timer again: it cannot tell who stalled.

A silent node is watched on, in or out of the generation, and is no longer silent once its
counter moves again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist

# How many agents watch each node: one more than the fewest that must freeze together for a
# node to go unwatched until the next generation.
WATCHED = 2
BEAT_ENV, TIMEOUT_ENV = "TESSERA_HEARTBEAT_S", "TESSERA_HEARTBEAT_TIMEOUT_S"
# Silent for over 1.5 s: known in under 2 s with the beat's own period; 6 beats missed before
# anyone is judged, so a loaded machine's scheduling delays do not read as a loss.
BEAT_S, TIMEOUT_S = 0.25, 1.5


def beat_key(node: str) -> str:
    return f"agent/{node}/beat"


def done_key(node: str) -> str:
    """Set by a node's agent that is leaving once the job has finished: not a loss."""
    return f"agent/{node}/done"


@dataclass(frozen=True)
class Settings:
    beat_s: float = BEAT_S
    timeout_s: float = TIMEOUT_S

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """From TESSERA_HEARTBEAT_S and TESSERA_HEARTBEAT_TIMEOUT_S; ValueError (one line)
        when they are not positive numbers or leave fewer than 2 beats in a timeout."""
        values = []
        for name, default in ((BEAT_ENV, BEAT_S), (TIMEOUT_ENV, TIMEOUT_S)):
            text = env.get(name)
            try:
                value = default if text is None else float(text)
            except ValueError:
                value = -1.0
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {text!r}")
            values.append(value)
        beat_s, timeout_s = values
        if timeout_s < 2 * beat_s:
            raise ValueError(f"{TIMEOUT_ENV} ({timeout_s} s) must be at least twice "
                             f"{BEAT_ENV} ({beat_s} s): one late beat is no loss")
        return cls(beat_s, timeout_s)


def watched(nodes: Iterable[str], me: str, count: int = WATCHED) -> list[str]:
    """The nodes `me` watches among `nodes`: the next `count` after it in sorted order (none
    when it is not among them)."""
    ring = sorted(set(nodes))
    if me not in ring:
        return []
    at = ring.index(me)
    return [ring[(at + i) % len(ring)] for i in range(1, min(count, len(ring) - 1) + 1)]


@dataclass
class _Seen:
    count: int
    since: float  # when the observer saw it change, or first saw it (its own clock)
    moved: bool = False  # whether it changed while watched


class Heartbeat:
    """One agent's beat and its watch over others (module docstring); `tick` from the agent's
    main loop, as often as it likes."""

    def __init__(self, store: dist.Store, node: str, settings: Settings = Settings(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.node = node
        self.settings = settings
        self.clock = clock
        self.silent: dict[str, float] = {}  # node -> for how long it was silent when judged
        self._seen: dict[str, _Seen] = {}
        self._done: set[str] = set()
        self._last: float | None = None  # this agent's last beat

    def tick(self, nodes: Sequence[str]) -> list[str]:
        """Beat if one is due, and judge the watched among `nodes` (the generation in force's)
        and the silent ones: the nodes newly silent. Raises dist.DistError when the store
        cannot be reached."""
        now = self.clock()
        if self._last is not None and now - self._last < self.settings.beat_s:
            return []
        stalled = self._last is not None and now - self._last > self.settings.timeout_s
        self._last = now
        self.store.add(beat_key(self.node), 1)
        found = []
        watching = {*watched(nodes, self.node), *self.silent} - self._done
        self._seen = {node: seen for node, seen in self._seen.items() if node in watching}
        for node in watching:
            count = self.store.add(beat_key(node), 0)  # reads it (creates it at 0: no beat)
            seen = self._seen.get(node)
            if seen is None:
                self._seen[node] = _Seen(count, now)
                continue
            if seen.count != count:
                self._seen[node] = _Seen(count, now, moved=True)
                self.silent.pop(node, None)
                continue
            if stalled:
                seen.since = now
                continue
            quiet = now - seen.since
            if not seen.moved or node in self.silent or quiet <= self.settings.timeout_s:
                continue
            if self.store.check([done_key(node)]):
                self._done.add(node)
                continue
            self.silent[node] = quiet
            found.append(node)
        return sorted(found)

    def done(self) -> None:
        """This agent leaves a finished job: its silence from now on is no loss."""
        self.store.set(done_key(self.node), "1")
