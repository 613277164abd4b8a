"""GPU health from dcgm-exporter pages: both field generations rendered from simulated GPUs,
the job's fatal XIDs, stale and unreachable endpoints, hostile pages, and a flapping GPU."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tessera_agents.health.dcgm import (
    FAMILIES,
    MAX_PAGE_BYTES,
    FlapDamper,
    assess,
    classify,
    read_page,
)
from tessera_agents.power.sim_backend import SimBackend
from tessera_contracts.gpuhealth import NodeHealth, State
from tessera_dev.simnode.dcgm import GENERATIONS, render

pytestmark = pytest.mark.monitoring

HOST = "gpu-node-0"
GPUS = 8
T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def gpus(clock: Clock) -> SimBackend:
    return SimBackend(count=GPUS, node=HOST, clock=clock)


def page(backend: SimBackend, generation: str, *, opt_in: bool = True) -> str:
    text = render(backend.snapshot(), hostname=HOST, generation=generation)
    if opt_in:
        return text
    # the exporter's default counters without the opt-in DCGM_EXP_* collectors
    return "\n".join(line for line in text.splitlines() if "DCGM_EXP_" not in line)


def states(health: NodeHealth) -> dict[int, State]:
    return {g.index: g.state for g in health.gpus}


@pytest.mark.parametrize("opt_in", [True, False], ids=["with-exp-families", "last-xid-only"])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_a_gpu_that_fell_off_the_bus_is_failed_until_it_is_restored(
        gpus: SimBackend, generation: str, opt_in: bool) -> None:
    assert classify(page(gpus, generation, opt_in=opt_in), gpus=GPUS, hostname=HOST) \
        .indices(State.HEALTHY) == frozenset(range(GPUS))

    gpus.fail(3, xid=79)
    health = classify(page(gpus, generation, opt_in=opt_in), gpus=GPUS, hostname=HOST)
    assert health.indices(State.FAILED) == {3}
    assert health.gpus[3].xid == 79
    assert health.indices(State.HEALTHY) == frozenset(range(GPUS)) - {3}
    assert health.problems == ()

    # restored: the last XID reads 0 again while the window still counts the 79 from before
    gpus.restore(3)
    assert classify(page(gpus, generation, opt_in=opt_in), gpus=GPUS, hostname=HOST) \
        .indices(State.HEALTHY) == frozenset(range(GPUS))


@pytest.mark.parametrize("generation", GENERATIONS)
def test_an_xid_outside_the_fatal_list_keeps_the_gpu(gpus: SimBackend, generation: str) -> None:
    gpus.fail(2, xid=13)  # graphics engine exception: an application error
    text = page(gpus, generation)
    default = classify(text, gpus=GPUS, hostname=HOST)
    assert default.gpus[2].state is State.HEALTHY
    assert "13 not fatal" in default.gpus[2].reason
    crd_default = [48, 64, 74, 79, 94, 95, 119, 120, 140, 143, 144, 145, 149]
    assert classify(text, gpus=GPUS, fatal_xids=crd_default).gpus[2].state is State.HEALTHY
    strict = classify(text, gpus=GPUS, fatal_xids=[13, 79])
    assert (strict.gpus[2].state, strict.gpus[2].xid) == (State.FAILED, 13)


def test_a_fatal_xid_overwritten_by_a_later_one_still_counts(gpus: SimBackend) -> None:
    gpus.fail(5, xid=79)
    gpus.fail(5, xid=13)  # the last-XID gauge now reads 13; the window holds both
    health = classify(page(gpus, "4.9"), gpus=GPUS)
    assert (health.gpus[5].state, health.gpus[5].xid) == (State.FAILED, 79)


def test_the_parser_reads_what_prometheus_client_reads(gpus: SimBackend) -> None:
    gpus.fail(1, xid=79)
    gpus.fail(6, xid=94)
    for generation in GENERATIONS:
        text = page(gpus, generation)
        # the client's parser appends `_total` to a counter sample whose name ends in an
        # upper-case `_TOTAL`: its name on the page is the family's
        reference = sorted(
            (family.name, sorted(s.labels.items()), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples
            if family.name in FAMILIES)
        ours = sorted((s.name, sorted(s.labels.items()), s.value) for s in read_page(text))
        assert ours == reference and len(ours) > 3 * GPUS


def test_a_stale_or_unreachable_exporter_is_unknown(gpus: SimBackend, clock: Clock) -> None:
    gpus.fail(0, xid=79)
    text = page(gpus, "4.8")
    fresh = assess(text, fetched_at=clock.now, now=clock.now + 59, gpus=GPUS)
    assert fresh.indices(State.FAILED) == {0}
    stale = assess(text, fetched_at=clock.now, now=clock.now + 61, gpus=GPUS,
                   error="connection refused")
    assert stale.indices(State.UNKNOWN) == frozenset(range(GPUS))
    assert "61 s old" in stale.gpus[0].reason and "connection refused" in stale.gpus[0].reason
    down = assess(None, fetched_at=None, now=clock.now, gpus=GPUS, error="timed out")
    assert down.indices(State.UNKNOWN) == frozenset(range(GPUS))
    assert "timed out" in down.gpus[0].reason
    # samples carrying an old timestamp are skipped, not believed
    stamped = "\n".join(f"{line} {int((clock.now - 120) * 1000)}" if line.startswith("DCGM")
                        else line for line in text.splitlines())
    old = assess(stamped, fetched_at=clock.now, now=clock.now, gpus=GPUS)
    assert old.indices(State.UNKNOWN) == frozenset(range(GPUS))
    assert any("120 s old" in p for p in old.problems)


def test_a_missing_gpu_is_unknown(gpus: SimBackend) -> None:
    text = "\n".join(line for line in page(gpus, "4.9").splitlines() if 'gpu="7"' not in line)
    health = classify(text, gpus=GPUS)
    assert health.indices(State.UNKNOWN) == {7}
    assert health.indices(State.HEALTHY) == frozenset(range(7))


XID = 'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-0",hostname="gpu-node-0"'


@pytest.mark.parametrize("line, problem", [
    (f"{XID}}} 1e308", "is not an XID"),
    (f"{XID}}} NaN", "is not an XID"),
    (f"{XID}}} 9.223372036854775e+18", "is not an XID"),
    (f"{XID}}} -79", "is not an XID"),
    (f"{XID}}} 79.5", "is not an XID"),
    ('DCGM_FI_DEV_XID_ERRORS{gpu="0\\",gpu=\\"1",hostname="gpu-node-0"} 79', "no GPU"),
    ('DCGM_FI_DEV_XID_ERRORS{gpu="' + "9" * 5000 + '"} 79', "no GPU"),
    ('DCGM_FI_DEV_XID_ERRORS{gpu="0",hostname="gpu-node-1"} 79', "not 'gpu-node-0'"),
    ('DCGM_EXP_XID_ERRORS_COUNT{gpu="0",xid="' + "7" * 5000 + '"} 1', "is not an XID"),
    ('DCGM_EXP_GPU_HEALTH_STATUS{gpu="0",health_watch="PCIE"} 1e300', "not 0, 10 or 20"),
])
def test_hostile_samples_are_skipped_with_the_reason(line: str, problem: str) -> None:
    health = classify(line + "\n", gpus=GPUS, hostname=HOST)
    assert health.gpus[0].state is State.UNKNOWN
    assert any(problem in p for p in health.problems), health.problems


@pytest.mark.parametrize("text, why", [
    (f'{XID},gpu="1"}} 79', "given twice"),
    (f"{XID}}} 79 12 13", "optional timestamp"),
    (f"{XID} 79", "',' or '}'"),
    ('DCGM_FI_DEV_XID_ERROR{gpu="0\\q"} 79', "bad escape"),
    ('DCGM_FI_DEV_XID_ERROR{gpu="0} 79', "unterminated"),
    ("DCGM_EXP_GPU_HEALTH_STATUS{gpu=0} 0", "no quoted value"),
    ("DCGM_FI_DEV_XID_ERROR 1_0", "bad value"),
])
def test_a_malformed_page_makes_every_gpu_unknown(gpus: SimBackend, text: str,
                                                  why: str) -> None:
    gpus.fail(4, xid=79)
    health = classify(page(gpus, "4.8") + text + "\n", gpus=GPUS)
    assert health.indices(State.UNKNOWN) == frozenset(range(GPUS))
    assert "malformed" in health.gpus[0].reason and why in health.gpus[0].reason


def test_an_enormous_page_is_refused_unread() -> None:
    text = "#" * (MAX_PAGE_BYTES + 1)
    health = classify(text, gpus=GPUS)
    assert health.indices(State.UNKNOWN) == frozenset(range(GPUS))
    assert "exceeds" in health.gpus[0].reason


def test_a_page_at_the_size_bound_is_read_in_linear_time() -> None:
    """One label value of 2M escapes fills the page: read in about 2.5 s here, where a scan
    from each escape to the closing quote (quadratic) took 345 s. The bound is the behaviour:
    an agent that reads its exporter every few seconds must not stall on a hostile page."""
    head = 'DCGM_FI_DEV_XID_ERRORS{gpu="0",v="'
    text = head + "\\n" * ((MAX_PAGE_BYTES - len(head) - 10) // 2) + '"} 0\n'
    started = time.perf_counter()
    health = classify(text, gpus=GPUS)
    assert time.perf_counter() - started < 60
    assert health.gpus[0].state is State.HEALTHY


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('DCGM_FIEXPRTOSxidgpu{}=",\\ \n0179.eN+-#')),
               max_size=400))
def test_any_text_gives_a_verdict_for_every_gpu(text: str) -> None:
    health = classify(text, gpus=GPUS, hostname=HOST)
    assert [g.index for g in health.gpus] == list(range(GPUS))


def test_a_gpu_flapping_three_times_in_a_minute_changes_the_layout_twice(
        gpus: SimBackend, clock: Clock) -> None:
    """The exporter is read every 5 s; GPU 3 fails at 0, 20 and 40 s and recovers 5 s after
    each. Undamped that is six changes of the layout; damped, two: out at 0 s, and back once it
    has been healthy for the hold-down of its third failure, 60 s x 2^2 = 240 s from 45 s."""
    damper = FlapDamper()
    assert damper.hold(3) == 240
    raw_changes, damped_changes = [], []
    raw_last = damped_last = State.HEALTHY
    for tick in range(0, 400, 5):
        clock.now = T0 + tick
        if tick in (0, 20, 40):
            gpus.fail(3, xid=79)
        elif tick in (5, 25, 45):
            gpus.restore(3)
        observed = classify(page(gpus, "4.9"), gpus=GPUS)
        damped = damper.update(clock.now, observed)
        if observed.gpus[3].state is not raw_last:
            raw_changes.append(tick)
            raw_last = observed.gpus[3].state
        if damped.gpus[3].state is not damped_last:
            damped_changes.append(tick)
            damped_last = damped.gpus[3].state
        assert damped.indices(State.HEALTHY) >= frozenset(range(GPUS)) - {3}
    assert raw_changes == [0, 5, 20, 25, 40, 45]
    assert damped_changes == [0, 45 + 240]


def test_unknown_is_not_health_for_a_held_gpu(gpus: SimBackend, clock: Clock) -> None:
    damper = FlapDamper(hold_down=30)
    gpus.fail(1, xid=79)
    damper.update(clock.now, classify(page(gpus, "4.8"), gpus=GPUS))
    gpus.restore(1)
    clock.now += 20
    assert damper.update(clock.now, classify(page(gpus, "4.8"), gpus=GPUS)).gpus[1].state \
        is State.FAILED
    clock.now += 20  # 40 s after the failure, but the exporter was unreachable in between
    held = damper.update(clock.now, assess(None, fetched_at=None, now=clock.now, gpus=GPUS))
    assert held.gpus[1].state is State.FAILED and "unreachable" in held.gpus[1].reason
    assert held.gpus[0].state is State.UNKNOWN
    states_seen = []
    for wait in (5, 29, 1):  # healthy again from the first of these: released after 30 s
        clock.now += wait
        states_seen.append(
            damper.update(clock.now, classify(page(gpus, "4.8"), gpus=GPUS)).gpus[1].state)
    assert states_seen == [State.FAILED, State.FAILED, State.HEALTHY]
