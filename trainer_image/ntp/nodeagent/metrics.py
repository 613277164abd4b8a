"""The trainer's Prometheus metrics: goodput, badput by category, throughput and layout, read
from its goodput ledger on every scrape, the loss of the last step that counts, and the
distribution of its step times.

One `Ledger.account()` per scrape, so every value on a page is of the same instant and
`tessera_productive_seconds + sum(tessera_badput_seconds_total) == tessera_wall_seconds_total`
holds on each page (to float rounding). Productive time is a gauge, named without `_total`: a
rollback moves time from it to `lost_progress`, so it falls, and a counter that fell would read
as a reset to `rate` and `increase`; the other totals are counters. Labels: `ntpjob` (the
NTPTrainingJob; `job` is Prometheus' own target label) and whatever the caller adds (e.g.
`node`); the scrape adds `namespace` and `pod` (manifests/monitoring).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import HTTPServer

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from tessera_contracts.vocabulary import BADPUT_CATEGORIES, Phase
from tessera_core.goodput import Ledger

Loss = Callable[[], float | None]  # the last step's loss; None before the first step

# Upper bounds of the step-time histogram's buckets, in seconds, each 1.5 to 2 times the one
# before: from the CPU demo's steps (0.1-2 s) through large GPU steps (1-30 s) to stalls, so that
# a quantile read from them (interpolated within its bucket) is off by less than a bucket's width.
STEP_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 4.0, 6.0, 10.0, 15.0, 25.0,
                40.0, 60.0, 120.0)


class StepTimes:
    """The durations of the steps a trainer completed, counted into `STEP_BUCKETS`; safe to
    observe and read (a scrape) from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(STEP_BUCKETS) + 1)  # per bucket; the last is above them all
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
            self._sum += seconds

    def buckets(self) -> tuple[list[tuple[str, float]], float]:
        """The cumulative count at or below each bound (`+Inf` last), and the sum of seconds."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        bounds = [*(repr(b) for b in STEP_BUCKETS), "+Inf"]
        cumulative, running = [], 0
        for bound, count in zip(bounds, counts, strict=True):
            running += count
            cumulative.append((bound, float(running)))
        return cumulative, total


class GoodputCollector(Collector):
    """Yields fresh metric families from the ledger on each scrape; keeps nothing itself."""

    def __init__(self, ledger: Ledger, labels: Mapping[str, str], loss: Loss | None = None,
                 step_times: StepTimes | None = None, eval_loss: Loss | None = None) -> None:
        self._ledger = ledger
        self._labels = dict(labels)
        self._loss = loss or (lambda: None)
        self._eval_loss = eval_loss or (lambda: None)
        self._step_times = step_times or StepTimes()

    def _family(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                help_: str, value: float | None, **extra: str) -> Metric:
        family = kind(name, help_, labels=[*self._labels, *extra])
        if value is not None:
            family.add_metric([*self._labels.values(), *extra.values()], value)
        return family

    def collect(self) -> Iterator[Metric]:
        a = self._ledger.account()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "tessera_goodput_ratio",
                           "Productive time over wall time (docs/goodput.md)", a.goodput)
        yield self._family(counter, "tessera_wall_seconds",
                           "Time since the trainer started", float(a.wall))
        yield self._family(gauge, "tessera_productive_seconds",
                           "Training time of steps that count (falls when a rollback undoes "
                           "steps)", float(a.productive))
        badput = CounterMetricFamily("tessera_badput_seconds",
                                     "Time that did not train steps that count, by category",
                                     labels=[*self._labels, "category"])
        for category in BADPUT_CATEGORIES:
            badput.add_metric([*self._labels.values(), category], float(a.badput[category]))
        yield badput
        yield self._family(counter, "tessera_tokens", "Tokens processed by completed steps",
                           a.tokens)
        yield self._family(counter, "tessera_samples", "Samples processed by completed steps",
                           a.samples)
        yield self._family(gauge, "tessera_step", "The last step that counts", a.step)
        yield self._family(gauge, "tessera_steps_counted",
                           "Steps that count since the trainer started (the step form of "
                           "goodput: this x the ideal step time / wall time)", a.steps_counted)
        yield self._family(counter, "tessera_steps_lost", "Steps undone by rollbacks",
                           a.steps_lost)
        yield self._family(gauge, "tessera_loss",
                           "The job's loss at the last step that counts (NaN once it diverges)",
                           self._loss())
        yield self._family(gauge, "tessera_eval_loss",
                           "The job's loss on its held-out split at the newest evaluation",
                           self._eval_loss())
        buckets, total = self._step_times.buckets()
        steps = HistogramMetricFamily("tessera_step_seconds",
                                      "Duration of the completed steps, as the ranks measure them",
                                      labels=list(self._labels))
        steps.add_metric(list(self._labels.values()), buckets, total)
        yield steps
        yield self._family(counter, "tessera_reconfigurations",
                           "Live reconfigurations entered", a.reconfigurations)
        tp = GaugeMetricFamily("tessera_replica_tp_degree",
                               "Tensor-parallel degree of each replica in the running layout",
                               labels=[*self._labels, "replica"])
        for replica, degree in sorted(a.tp_degrees.items()):
            tp.add_metric([*self._labels.values(), str(replica)], degree)
        yield tp
        phase = GaugeMetricFamily("tessera_trainer_phase", "1 for the phase the trainer is in",
                                  labels=[*self._labels, "phase"])
        for p in Phase:
            phase.add_metric([*self._labels.values(), p.value], float(p is a.phase))
        yield phase


def registry(ledger: Ledger, labels: Mapping[str, str], loss: Loss | None = None,
             step_times: StepTimes | None = None, eval_loss: Loss | None = None
             ) -> CollectorRegistry:
    """A registry holding only the ledger's collector (no process or platform metrics)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(GoodputCollector(ledger, labels, loss, step_times, eval_loss))
    return reg


def serve(ledger: Ledger, addr: str, port: int, labels: Mapping[str, str],
          loss: Loss | None = None, step_times: StepTimes | None = None,
          eval_loss: Loss | None = None) -> HTTPServer:
    """Serve the ledger's metrics, `loss` and `eval_loss` read on each scrape and `step_times`
    (none observed without it), at http://addr:port/metrics from a daemon thread; port 0 picks a
    free port (the server's `server_port`). `shutdown()` stops it."""
    server, _thread = start_http_server(
        port, addr, registry(ledger, labels, loss, step_times, eval_loss))
    return server
