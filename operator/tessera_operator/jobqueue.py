"""The jobs' reconciles as a work queue: one at a time per job, and a storm of events per job
covered by one reconcile.

Watch events of other kinds (a job's pods, its nodes, their GPUHealth, its progress reports,
its children and power targets) are mapped to the job they concern (`handlers`) and reconcile
it. kopf serialises the handlers of one object and batches that object's events, but it has
no queue keyed by another resource's owner: events of a job's nodes, pods and reports are
neither coalesced per job nor serialised with the job's own handlers. This queue does both, as
controller-runtime's work queue does (a key waiting to start is not added twice; a key runs in
one worker at a time). It also keeps which jobs wait for their power agents' reports and which
for nodes that fit them, the events that reconcile a job only while it waits.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

JobKey = tuple[str, str]  # (namespace, name)
# Timed reconciles (resyncs, TTLs, retries) run in these threads: a slow one must not delay the
# others, and thousands of jobs must not hold a thread each while they wait.
TIMED_WORKERS = 4


class JobQueue:
    """Per job: a lock, whether a watch-triggered reconcile waits to start, and whether the job
    waits for power agents' reports or for nodes. Thread-safe."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: defaultdict[JobKey, threading.Lock] = defaultdict(threading.Lock)
        self._waiting: set[JobKey] = set()
        self._held: set[JobKey] = set()
        self._unplaced: set[JobKey] = set()
        # key -> (sequence, run): the one timed reconcile each job waits for; the heap holds
        # (when, sequence, key), entries whose sequence is no longer the key's are stale.
        self._due: dict[JobKey, tuple[int, Callable[[], object]]] = {}
        self._heap: list[tuple[float, int, JobKey]] = []
        self._sequence = 0
        self._wake = threading.Condition(self._guard)
        self._clock: threading.Thread | None = None
        self._workers = ThreadPoolExecutor(TIMED_WORKERS, thread_name_prefix="timed-reconcile")

    def add(self, key: JobKey) -> bool:
        """A watch event asks for a reconcile of `key`; False when one is already waiting to
        start (it will observe the change: watch events come in storms, every node of a job at
        startup, a rack losing power)."""
        with self._guard:
            if key in self._waiting:
                return False
            self._waiting.add(key)
            return True

    @contextmanager
    def running(self, key: JobKey) -> Iterator[None]:
        """Hold the job's lock; once held, every change is observed by this reconcile, so a
        new event asks for another."""
        with self._guard:
            lock = self._locks[key]
        with lock:
            with self._guard:
                self._waiting.discard(key)
            yield

    def hold(self, key: JobKey, held: bool) -> None:
        """Whether the job's power raises wait for cuts to be reported in effect: while they
        do, an agent's report on one of its targets reconciles it. Set before the targets are
        read, so that a report made after the read is not lost."""
        with self._guard:
            if held:
                self._held.add(key)
            else:
                self._held.discard(key)

    def wait_for_nodes(self, key: JobKey, waiting: bool) -> None:
        """Whether too few nodes fit the job, so that any node change reconciles it. Set by
        its reconcile before that checks whether the node cache changed while it placed: a
        node event delivered after the check finds the job here (the job's status, read back
        through its watch, would come too late for an event in between)."""
        with self._guard:
            if waiting:
                self._unplaced.add(key)
            else:
                self._unplaced.discard(key)

    def waiting_for_nodes(self) -> set[JobKey]:
        with self._guard:
            return set(self._unplaced)

    def holds(self, key: JobKey) -> bool:
        with self._guard:
            return key in self._held

    def after(self, key: JobKey, seconds: float, run: Callable[[], object]) -> None:
        """Call `run` (a reconcile of `key`) in `seconds`, in a worker thread: a job that needs
        one at a time (its resync, its TTL, a retry) rather than on an event. A later call
        replaces an earlier one."""
        with self._guard:
            self._sequence += 1
            when = time.monotonic() + max(0.0, seconds)
            self._due[key] = (self._sequence, run)
            heapq.heappush(self._heap, (when, self._sequence, key))
            if self._clock is None:
                self._clock = threading.Thread(target=self._tick, name="job-queue-clock",
                                               daemon=True)
                self._clock.start()
            self._wake.notify()

    def _tick(self) -> None:
        while True:
            with self._guard:
                run = self._next_due()
            self._workers.submit(run)

    def _next_due(self) -> Callable[[], object]:
        """Wait (holding the guard's condition) for the earliest timed reconcile, and take it."""
        while True:
            while self._heap and self._due.get(self._heap[0][2], (-1,))[0] != self._heap[0][1]:
                heapq.heappop(self._heap)
            if not self._heap:
                self._wake.wait()
                continue
            when, _, key = self._heap[0]
            delay = when - time.monotonic()
            if delay > 0:
                self._wake.wait(delay)
                continue
            heapq.heappop(self._heap)
            return self._due.pop(key)[1]

    def forget(self, key: JobKey) -> None:
        """The job is gone: keep nothing of it."""
        with self._guard:
            self._locks.pop(key, None)
            self._held.discard(key)
            self._unplaced.discard(key)
            self._waiting.discard(key)
            self._due.pop(key, None)
