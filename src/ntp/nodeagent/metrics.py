"""The trainer's Prometheus metrics: goodput, badput by category, throughput and layout, read
from its goodput ledger on every scrape, and the loss of the last step that counts.

One `Ledger.account()` per scrape, so every value on a page is of the same instant and
`tessera_productive_seconds_total + sum(tessera_badput_seconds_total) ==
tessera_wall_seconds_total` holds on each page (to float rounding). Productive time is a gauge:
a rollback moves time from it to `lost_progress`, so it can fall; the other totals are counters.
Labels: `ntpjob` (the NTPTrainingJob; `job` is Prometheus' own target label) and whatever the
caller adds (e.g. `replica`); the scrape adds `namespace` and `pod` (manifests/monitoring).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from http.server import HTTPServer

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from tessera_contracts.vocabulary import BADPUT_CATEGORIES, Phase
from tessera_core.goodput import Ledger

Loss = Callable[[], float | None]  # the last step's loss; None before the first step


class GoodputCollector(Collector):
    """Yields fresh metric families from the ledger on each scrape; keeps nothing itself."""

    def __init__(self, ledger: Ledger, labels: Mapping[str, str], loss: Loss | None = None
                 ) -> None:
        self._ledger = ledger
        self._labels = dict(labels)
        self._loss = loss or (lambda: None)

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
        yield self._family(gauge, "tessera_productive_seconds_total",
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
        yield self._family(gauge, "tessera_step_seconds", "Duration of the last completed step",
                           None if a.last_step_seconds is None else float(a.last_step_seconds))
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


def registry(ledger: Ledger, labels: Mapping[str, str], loss: Loss | None = None
             ) -> CollectorRegistry:
    """A registry holding only the ledger's collector (no process or platform metrics)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(GoodputCollector(ledger, labels, loss))
    return reg


def serve(ledger: Ledger, addr: str, port: int, labels: Mapping[str, str],
          loss: Loss | None = None) -> HTTPServer:
    """Serve the ledger's metrics, and `loss` read on each scrape, at http://addr:port/metrics
    from a daemon thread; port 0 picks a free port (the server's `server_port`). `shutdown()`
    stops it."""
    server, _thread = start_http_server(port, addr, registry(ledger, labels, loss))
    return server
