"""The trainer's goodput exporter scraped by a real Prometheus: the ledger's figures, the last
step's loss and the step-time histogram arrive, and productive + badput equals wall time in
PromQL; the node agent times each of the job's steps once, whichever of its ranks reports it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ntp.nodeagent.metrics import StepTimes, registry, serve
from ntp.nodeagent.progress import NodeProgress
from tessera_contracts.rank_events import EvalRecord, StepRecord
from tessera_contracts.vocabulary import Phase
from tessera_core.goodput import Ledger
from tessera_dev.controlplane.prometheus import Prometheus

pytestmark = pytest.mark.monitoring

LABELS = {"ntpjob": "llama-small", "replica": "0"}
# Prometheus adds the terms in float64: each of the nine is rounded once on the page (repr
# round-trips) and each addition once, so the sum is off by at most 2 x 9 x 2^-53 of the wall.
REL = 18 * 2.0**-53
LOSS = 5.546875  # the last step's loss as the node agent read it (exact in binary and decimal)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def trained() -> Iterator[tuple[Ledger, int]]:
    """A trainer's ledger frozen after a run with every kind of event, and its steps' times,
    served on a free port. Startup 7 s; steps 1-3 of 0.5 s at TP 8,8; a 2.5 s save; 0.25 s into
    step 4 a GPU fails; a 4 s relayout to 7,8; 1.5 s waiting for health; rollback to step 3; 3 s
    restore; steps 4-5 of 0.75 s. Wall 7 + 1.5 + 2.5 + 0.25 + 4 + 1.5 + 3 + 1.5 = 21.25 s;
    productive 3 s."""
    clock = Clock()
    ledger = Ledger(clock)
    steps = StepTimes()
    ledger.set_layout({0: 8, 1: 8})
    clock.now += 7
    ledger.enter(Phase.TRAINING)
    for step in (1, 2, 3):
        clock.now += 0.5
        ledger.step_done(step, samples=16, tokens=16 * 128)
        steps.observe(0.5)
    ledger.enter(Phase.CHECKPOINT_SAVE)
    clock.now += 2.5
    ledger.checkpointed(3)
    ledger.enter(Phase.TRAINING)
    clock.now += 0.25
    ledger.enter(Phase.RECONFIGURATION)
    clock.now += 4
    ledger.set_layout({0: 7, 1: 8})
    ledger.enter(Phase.WAITING_FOR_HEALTH)
    clock.now += 1.5
    ledger.enter(Phase.CHECKPOINT_RESTORE)
    ledger.rollback(3)
    clock.now += 3
    ledger.enter(Phase.TRAINING)
    for step in (4, 5):
        clock.now += 0.75
        ledger.step_done(step, samples=16, tokens=16 * 128)
        steps.observe(0.75)
    server = serve(ledger, "127.0.0.1", 0, LABELS, lambda: LOSS, steps)
    yield ledger, server.server_port
    server.shutdown()
    server.server_close()


def one(prom: Prometheus, promql: str) -> float:
    (sample,) = prom.wait_for(promql)
    return sample.value


def test_prometheus_scrapes_goodput_and_badput_that_add_up(prometheus, trained) -> None:
    ledger, port = trained
    prom = prometheus({"trainer": [f"127.0.0.1:{port}"]})
    wall = one(prom, 'tessera_wall_seconds_total{ntpjob="llama-small"}')
    assert wall == 21.25
    assert one(prom, "tessera_productive_seconds") == 3.0
    assert one(prom, "tessera_goodput_ratio") == pytest.approx(3 / 21.25, rel=2.0**-52)
    badput = {s.labels["category"]: s.value
              for s in prom.wait_for("tessera_badput_seconds_total")}
    assert badput == {"startup": 7.0, "reconfiguration": 4.0, "restart": 0.0,
                      "checkpoint_save": 2.5, "checkpoint_restore": 3.0,
                      "waiting_for_health": 1.5, "other": 0.0, "lost_progress": 0.25}
    gap = one(prom, "abs(tessera_productive_seconds + "
                    "sum without (category) (tessera_badput_seconds_total) "
                    "- tessera_wall_seconds_total) / tessera_wall_seconds_total")
    assert gap <= REL
    tp = {s.labels["replica"]: s.value for s in prom.wait_for("tessera_replica_tp_degree")}
    assert tp == {"0": 7.0, "1": 8.0}
    assert one(prom, "tessera_step") == 5
    assert one(prom, "tessera_steps_lost_total") == 0
    # the step form, with the healthy layout's step (0.5 s at TP 8,8) as the ideal: the two
    # steps at 7,8 took 0.75 s, so the step form is below the time form
    assert one(prom, "tessera_steps_counted") == 5
    step_form = one(prom, "tessera_steps_counted * 0.5 / tessera_wall_seconds_total")
    assert step_form == pytest.approx(ledger.account().step_goodput(0.5), rel=2.0**-51)
    assert step_form == pytest.approx(2.5 / 21.25, rel=2.0**-51)
    assert one(prom, "tessera_tokens_total") == 5 * 16 * 128
    assert one(prom, "tessera_samples_total") == 5 * 16
    buckets = {s.labels["le"]: s.value for s in prom.wait_for("tessera_step_seconds_bucket")}
    assert (buckets["0.4"], buckets["0.6"], buckets["1.0"], buckets["+Inf"]) == (0, 3, 5, 5)
    assert one(prom, "tessera_step_seconds_count") == 5
    assert one(prom, "tessera_step_seconds_sum") == 3 * 0.5 + 2 * 0.75
    (loss,) = prom.wait_for("tessera_loss")
    assert loss.value == LOSS and {k: loss.labels[k] for k in LABELS} == LABELS
    assert one(prom, "tessera_reconfigurations_total") == 1
    assert one(prom, 'tessera_trainer_phase{phase="training"}') == 1
    assert one(prom, "sum(tessera_trainer_phase)") == 1
    assert ledger.account().wall == 21.25


def test_the_node_agent_times_each_step_once_as_its_ranks_measured_it() -> None:
    """Every rank of a node prints every step: the histogram counts the step at the first line,
    with the step time the rank measured (not the time between the lines' arrival)."""
    progress = NodeProgress("gpu-node-0", steps=10, clock=Clock())
    for step, seconds in ((1, 0.3), (2, 0.5), (3, 2.0)):
        for rank in (0, 1):
            progress.read(StepRecord(step=step, rank=rank, generation=1, loss=2.0,
                                     step_s=seconds + rank, samples=8).to_line().encode())
    reg = registry(progress.ledger, {"ntpjob": "llama-small", "node": "gpu-node-0"},
                   step_times=progress.step_times)
    (family,) = (f for f in reg.collect() if f.name == "tessera_step_seconds")
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("tessera_step_seconds_count", None)] == 3
    assert samples[("tessera_step_seconds_sum", None)] == 0.3 + 0.5 + 2.0
    assert (samples[("tessera_step_seconds_bucket", "0.25")],
            samples[("tessera_step_seconds_bucket", "0.4")],
            samples[("tessera_step_seconds_bucket", "0.6")],
            samples[("tessera_step_seconds_bucket", "2.5")]) == (0, 1, 2, 3)


def test_the_node_agent_serves_the_newest_held_out_loss_beside_the_training_loss() -> None:
    progress = NodeProgress("gpu-node-0", steps=10, clock=Clock())
    reg = registry(progress.ledger, LABELS, lambda: progress.loss,
                   progress.step_times, lambda: progress.eval_loss)

    def gauge(name: str) -> list[float]:
        (family,) = (f for f in reg.collect() if f.name == name)
        return [s.value for s in family.samples]

    assert gauge("tessera_eval_loss") == []  # nothing evaluated yet: no sample, not a zero
    for step, loss, held_out in ((1, 3.5, None), (2, 3.0, 3.25), (3, 2.75, None)):
        for rank in (0, 1):
            progress.read(StepRecord(step=step, rank=rank, generation=1, loss=loss,
                                     step_s=0.1, samples=8).to_line().encode())
            if held_out is not None:
                progress.read(EvalRecord(step=step, rank=rank, generation=1,
                                         eval_loss=held_out, samples=16).to_line().encode())
    assert (gauge("tessera_loss"), gauge("tessera_eval_loss")) == ([2.75], [3.25])
