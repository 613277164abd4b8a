"""Engine and policy arithmetic on hand-made failure states, checked against hand-derived values."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tessera_core.perf_model import PAPER
from tessera_sim import report
from tessera_sim.analysis import StudySettings, loss_curve, run_study, trace_stats
from tessera_sim.config import FailureConfig, PolicyConfig, SimConfig
from tessera_sim.engine import SECONDS_PER_DAY, run_trace
from tessera_sim.failures import (
    FailureTrace,
    Topology,
    sample_down_blocks,
    sample_trace,
)
from tessera_sim.policies import POLICY_NAMES, build_policies

pytestmark = pytest.mark.sim


def _trace(days: float, *failures: tuple[float, float, int]) -> FailureTrace:
    """A trace from (start day, end day, block) triples."""
    start, end, block = (np.array(col) for col in zip(*failures, strict=True))
    return FailureTrace(start, end, block.astype(int), days)


def _by_name(values: np.ndarray) -> dict[str, float]:
    return dict(zip(POLICY_NAMES, values.tolist(), strict=True))


def test_one_failure_costs_each_policy_what_its_mechanism_says(paper_config, paper_policies):
    # GPU 0 (replica 0, stage 0) is down from day 1 to day 4 of a 10-day trace.
    topo = Topology.of(paper_config)
    result = run_trace(paper_config, topo, _trace(10.0, (1.0, 4.0, 0)), paper_policies)
    down_share = 3.0 / 10.0
    mean = _by_name(result.mean_throughput())
    # DP-DROP loses replica 0 (its 7 intact groups cannot fill a replica): 1/128 for 3 days.
    assert mean["dp-drop"] == pytest.approx(1 - down_share / 128)
    assert mean["ckpt-restart"] == pytest.approx(1 - down_share / 128)
    # Plain NTP: replica 0 runs at TP31 with 31/32 of the batch.
    assert mean["ntp"] == pytest.approx(1 - down_share / 32 / 128)
    # A standby domain or a power boost covers it fully.
    assert mean["spares"] == pytest.approx(1.0)
    assert mean["ntp-pw"] == pytest.approx(1.0)
    assert mean["tessera"] == pytest.approx(1.0)
    # Pauses: a restart (10 min + half a 30-min checkpoint interval) at the failure for
    # checkpoint-restart; a 60 s reconfiguration at the failure and at the repair for the live
    # policies; a 120 s swap for spares.
    lost = _by_name(result.stall_loss * SECONDS_PER_DAY)
    assert lost["ckpt-restart"] == pytest.approx(1500 * 127 / 128)
    assert lost["dp-drop"] == pytest.approx(60 * 127 / 128 + 60)
    assert lost["ntp"] == pytest.approx(60 * (1 - 1 / 32 / 128) + 60)
    assert lost["spares"] == pytest.approx(120)
    assert _by_name(result.goodput())["tessera"] == pytest.approx(1 - 120 / SECONDS_PER_DAY / 10)
    # While GPU 0 is down, its 31 peers draw the power that buys 32/31 the speed: recover their
    # ratio from the job-level extra power and the group's peak, and check its speed.
    during = _by_name(result.extra_power[1])
    ratio = 1 + during["ntp-pw"] * paper_config.gpus / 31
    assert PAPER.speedup(ratio) == pytest.approx(32 / 31)
    assert during["ntp"] == 0.0
    assert _by_name(result.peak_group_power[1])["ntp-pw"] == pytest.approx(31 * ratio / 32)


def test_warm_up_failures_are_down_at_day_zero_and_overlaps_count_once(paper_config):
    policies = build_policies(paper_config)
    topo = Topology.of(paper_config)
    # Block 5 fails before day 0 and again at day 1 (still down), repaired at day 2 and day 3.
    trace = _trace(4.0, (-1.0, 2.0, 5), (1.0, 3.0, 5))
    result = run_trace(paper_config, topo, trace, policies)
    assert result.failed_fraction[0] == pytest.approx(1 / topo.gpus)
    np.testing.assert_allclose(result.length, [1.0, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(result.failed_fraction * topo.gpus, [1, 1, 1, 0])
    # Only the last repair changes anything: one 60 s reconfiguration, none at day 1 or 2.
    drop = POLICY_NAMES.index("dp-drop")
    assert result.stall_loss[drop] * SECONDS_PER_DAY == pytest.approx(60)


def _stall_s(result, name: str) -> float:
    return float(result.stall_loss[POLICY_NAMES.index(name)] * SECONDS_PER_DAY)


def test_a_pause_is_charged_only_to_policies_whose_groups_changed(paper_config, paper_policies):
    topo = Topology.of(paper_config)
    # GPUs 0 and 1 (one TP32 group) fail at days 1 and 2; GPU 1 is repaired at day 3, GPU 0
    # at day 4. Replica 0 is the only one touched: 127/128 of the job runs meanwhile.
    trace = _trace(5.0, (1.0, 4.0, 0), (2.0, 3.0, 1))
    result = run_trace(paper_config, topo, trace, paper_policies)
    rest = 127 / 128
    # Uniform TP lost the group at day 1: the second failure and the first repair change
    # nothing for it. Checkpoint-restart restarts once; DP-DROP reconfigures at days 1 and 4.
    assert _stall_s(result, "ckpt-restart") == pytest.approx(1500 * rest)
    assert _stall_s(result, "dp-drop") == pytest.approx(60 * rest + 60)
    # Plain NTP changes TP degree at every event (32 -> 31 -> 30 -> 31 -> 32).
    ntp_after = [1 - (1 / 32) / 128, 1 - (2 / 32) / 128, 1 - (1 / 32) / 128, 1.0]
    assert _stall_s(result, "ntp") == pytest.approx(60 * sum(ntp_after))
    # Spares swap in a standby group once, at the first failure.
    assert _stall_s(result, "spares") == pytest.approx(120)


def test_overlapping_pauses_merge_and_end_with_the_trace(paper_config, paper_policies):
    topo = Topology.of(paper_config)
    second = 30 / SECONDS_PER_DAY
    # Two failures 30 s apart in replicas 0 and 1: DP-DROP's 60 s pauses overlap, so the job is
    # paused 90 s, not 120 s; checkpoint-restart's 1,500 s restarts make 1,530 s. Throughput
    # stays 127/128: the 14 intact groups of the two hit replicas regroup into one.
    trace = _trace(5.0, (1.0, 9.0, 0), (1.0 + second, 9.0, 32 * 8))
    result = run_trace(paper_config, topo, trace, paper_policies)
    one = 127 / 128
    assert _stall_s(result, "dp-drop") == pytest.approx(90 * one)
    assert _stall_s(result, "ckpt-restart") == pytest.approx(1530 * one)
    # A failure 10 s before the trace ends pauses it for those 10 s only.
    late = _trace(1.0, (1.0 - 10 / SECONDS_PER_DAY, 9.0, 0))
    result = run_trace(paper_config, topo, late, paper_policies)
    assert _stall_s(result, "ckpt-restart") == pytest.approx(10 * one)
    # Pauses never exceed the time: goodput stays within [0, throughput].
    assert (result.goodput() >= 0).all()
    assert (result.goodput() <= result.mean_throughput()).all()


def test_warm_start_covers_the_slower_repair_kind(paper_config) -> None:
    # Only software failures, repaired in 5 days (slower than the 3-day hardware repairs): at
    # day 0 the number down must already be stationary, rate x GPUs x 5 days (~79 here).
    f = FailureConfig(hardware_share=0.0, software_repair_hours=120.0)
    cfg = replace(paper_config, failures=f).validate()
    topo = Topology.of(cfg)
    seeds = np.random.SeedSequence(3).spawn(16)
    down = [
        np.count_nonzero(sample_trace(cfg, topo, np.random.default_rng(s)).start_day < 0)
        for s in seeds
    ]
    expected = f.rate_per_gpu_day * topo.gpus * 5.0
    # 16 Poisson counts: the mean's standard error is sqrt(79 / 16) = 2.2, so 4 sigma is ~9.
    assert np.mean(down) == pytest.approx(expected, abs=4 * np.sqrt(expected / len(seeds)))


@pytest.mark.parametrize(
    ("cfg", "fractions", "failed_gpus"),
    [
        # 1,024 GPUs, single-GPU failures: 0.05% and 0.1% both round to one failed GPU.
        (
            SimConfig(
                gpus=1024, domain_size=8, tp=8, pp=4, dp=32, policy=PolicyConfig(spare_domains=0)
            ),
            (0.0005, 0.001),
            1,
        ),
        # 32K GPUs losing whole 32-GPU domains: both round to one domain (of 1,056 with spares).
        (SimConfig(failures=FailureConfig(blast_radius=32)), (0.0005, 0.001), 32),
    ],
)
def test_loss_rows_report_the_share_actually_failed(cfg, fractions, failed_gpus: int) -> None:
    cfg = cfg.validate()
    topo = Topology.of(cfg)
    policies = build_policies(cfg)
    rows = loss_curve(cfg, policies, fractions, 3, np.random.default_rng(0))
    by = {(r["requested_fraction"], r["policy"]): r for r in rows}
    for fraction in fractions:
        row = by[(fraction, "ntp")]
        assert row["failed_gpus"] == failed_gpus
        assert row["failed_fraction"] == failed_gpus / topo.gpus
        # One hit TP group, whatever was asked for: plain NTP runs its replica at (tp - lost) / tp
        # (a whole lost domain: the replica stops, 1/dp), and DP-DROP needs that group back.
        lost = min(failed_gpus, cfg.tp)
        assert row["loss_mean"] == pytest.approx(lost / cfg.tp / cfg.dp)
        assert by[(fraction, "dp-drop")]["spares_mean"] == 1


def test_reduced_replica_work_ratio_and_power_follow_n1_over_n2() -> None:
    cfg = SimConfig(gpus=8 * 4 * 16, domain_size=8, tp=8, pp=4, dp=16).validate()
    ntp, pw = (p for p in build_policies(cfg) if p.name in ("ntp", "ntp-pw"))
    reach = PAPER.speedup(1.3)
    # 8 -> 7 needs 8/7 = +14.3% speed: within +30% power (DESIGN.md section 5).
    assert ntp.speed[7] == pytest.approx(7 / 8)
    assert pw.speed[7] == 1.0
    assert PAPER.speedup(pw.power[7]) == pytest.approx(8 / 7)
    assert pw.power[7] < 1.3
    # 8 -> 6 needs 1.33x: beyond reach, so the boosted group runs at reach / (8/6).
    assert pw.speed[6] == pytest.approx(reach * 6 / 8)
    assert pw.power[6] == pytest.approx(1.3)
    # Below min TP (default tp/2 = 4) the group is unusable.
    assert ntp.speed[3] == 0.0 and pw.speed[3] == 0.0


@pytest.mark.parametrize("reduced", [31, 30, 28, 24, 17])
def test_tessera_uses_the_planners_work_which_stays_near_n1_over_n2(
    paper_config, paper_policies, reduced: int
) -> None:
    tessera = paper_policies[POLICY_NAMES.index("tessera")]
    needed = PAPER.speedup(tessera.power[reduced]) / tessera.speed[reduced]
    # The planner balances whole heads with MLP columns, so a 480B MHA layer at TP N2 costs
    # N1/N2 of the busiest rank's TP32 work within 0.1%, never less than perfect balance.
    ideal = paper_config.tp / reduced
    assert ideal * (1 - 1e-9) <= needed <= ideal * 1.001


def test_packing_puts_hit_groups_into_as_few_replicas_as_possible(paper_config, paper_policies):
    # 8 groups with 2 failures each, spread over 8 replicas (stage 0 of replicas 0..7).
    survivors = np.full(Topology.of(paper_config).groups, 32)
    survivors[[r * paper_config.pp for r in range(8)]] = 30
    by_name = {p.name: p for p in paper_policies}
    ntp, _ = by_name["ntp"].evaluate(survivors, paper_config.dp, paper_config.pp)
    assert ntp.throughput == pytest.approx(1 - 8 * (2 / 32) / 128)
    # Same speeds, packed: one replica at 30/32 instead of eight.
    packed, _ = replace(by_name["ntp"], packed=True).evaluate(
        survivors, paper_config.dp, paper_config.pp
    )
    assert packed.throughput == pytest.approx(1 - (2 / 32) / 128)


def test_a_seed_reproduces_the_whole_study_and_another_seed_does_not() -> None:
    cfg = SimConfig(gpus=8 * 4 * 32, domain_size=8, tp=8, pp=4, dp=32, days=5.0, seed=7)
    settings = StudySettings(fractions=(0.0, 0.01), tps=(8,), trials=3, traces=2)
    first = report.to_dict(run_study(cfg, settings))
    assert report.to_dict(run_study(cfg, settings)) == first
    other = report.to_dict(run_study(replace(cfg, seed=8), settings))
    assert other["trace"] != first["trace"]


def test_an_idle_spare_failing_costs_no_pause_but_a_serving_one_does(paper_config, paper_policies):
    topo = Topology.of(paper_config)
    spare = paper_config.gpus  # the first GPU of the first standby domain (TP group 1024)
    # Day 1: GPU 0 fails, spare group 1024 takes its place (a 120 s swap). Day 2: a GPU of spare
    # group 1029 fails; it serves in no replica, so nothing swaps. Day 3: serving group 1024
    # fails and the next standby (1025) swaps in: 120 s again.
    trace = _trace(5.0, (1.0, 9.0, 0), (2.0, 9.0, spare + 5 * 32), (3.0, 9.0, spare))
    result = run_trace(paper_config, topo, trace, paper_policies)
    assert _by_name(result.mean_throughput())["spares"] == pytest.approx(1.0)
    assert _stall_s(result, "spares") == pytest.approx(240)
    # An idle standby's failure alone costs nothing, and no other policy sees spare GPUs.
    idle = run_trace(paper_config, topo, _trace(5.0, (1.0, 4.0, spare)), paper_policies)
    assert (idle.stall_loss == 0).all()
    assert (idle.throughput == 1.0).all()


def test_failures_per_day_counts_events_not_increases_of_the_failed_share(paper_config):
    topo = Topology.of(paper_config)
    # Three failures in 4 days; the second hits block 5 while it is down, so the failed share
    # rises only twice.
    trace = _trace(4.0, (1.0, 3.0, 5), (2.0, 3.5, 5), (2.5, 9.0, 7))
    result = run_trace(paper_config, topo, trace, ())
    assert np.count_nonzero(np.diff(result.failed_fraction) > 0) == 2
    assert trace_stats([result])["failures_per_day"] == pytest.approx(3 / 4)


def _dp_rows(survivors: np.ndarray, dp: int, pp: int) -> np.ndarray:
    """(replica, stage) -> whether that TP group lost a GPU, from survivor counts."""
    return (survivors[: dp * pp] < survivors.max()).reshape(dp, pp)


def test_stage_aware_regrouping_takes_one_group_of_each_stage(paper_config, paper_policies):
    cfg = replace(paper_config, policy=replace(paper_config.policy, stage_aware_regroup=True))
    aware = {p.name: p for p in build_policies(cfg)}
    plain = {p.name: p for p in paper_policies}
    dp, pp = cfg.dp, cfg.pp
    survivors = np.full(Topology.of(cfg).groups, 32)
    # Stage 0 of replicas 0 and 1 lost a GPU: 14 intact groups, none of them a stage 0.
    survivors[[0, pp]] = 31
    # Ignoring stages they make one replica (of two stage-1 groups and no stage 0); honouring
    # stages they make none.
    assert plain["dp-drop"].evaluate(survivors, dp, pp)[0].throughput == pytest.approx(127 / 128)
    assert aware["dp-drop"].evaluate(survivors, dp, pp)[0].throughput == pytest.approx(126 / 128)
    # A standby domain may serve any stage: with spares both replicas are whole again.
    assert aware["spares"].evaluate(survivors, dp, pp)[0].throughput == pytest.approx(1.0)


def test_stage_aware_packing_packs_within_each_stage(paper_config, paper_policies):
    cfg = replace(paper_config, policy=replace(paper_config.policy, stage_aware_regroup=True))
    ntp = replace(next(p for p in paper_policies if p.name == "ntp"), packed=True)
    aware = replace(ntp, stage_aware=True)
    dp, pp = cfg.dp, cfg.pp
    slow = 1 - (2 / 32) / dp  # one replica at TP30 of 32
    # Eight TP30 groups, one in each stage of eight replicas: packing by stage collects them
    # into a single replica, as packing that ignores stages does.
    spread = np.full(Topology.of(cfg).groups, 32)
    spread[[r * pp + r for r in range(8)]] = 30
    assert aware.evaluate(spread, dp, pp)[0].throughput == pytest.approx(slow)
    assert ntp.evaluate(spread, dp, pp)[0].throughput == pytest.approx(slow)
    # Eight in stage 0: a replica holds one stage-0 group, so eight replicas run at TP30.
    same = np.full(Topology.of(cfg).groups, 32)
    same[[r * pp for r in range(8)]] = 30
    assert aware.evaluate(same, dp, pp)[0].throughput == pytest.approx(1 - 8 * (2 / 32) / dp)
    assert ntp.evaluate(same, dp, pp)[0].throughput == pytest.approx(slow)


def test_regrouping_matches_an_independent_count_on_random_failures(paper_config, paper_policies):
    # Random states at 0.4% failed: count, from the failed groups alone, the intact replicas and
    # how many new ones the broken replicas' intact groups make, with and without stages.
    cfg = replace(paper_config, policy=replace(paper_config.policy, stage_aware_regroup=True))
    aware = next(p for p in build_policies(cfg) if p.name == "dp-drop")
    plain, unpacked = (p for p in paper_policies if p.name in ("dp-drop", "dp-drop-unpacked"))
    topo, dp, pp = Topology.of(cfg), cfg.dp, cfg.pp
    rng = np.random.default_rng(4)
    for _ in range(8):
        survivors = topo.survivors(sample_down_blocks(topo, topo.blocks_for(0.004), rng))
        hit = _dp_rows(survivors, dp, pp)
        broken = hit.any(axis=1)
        intact = int((~broken).sum())
        per_stage = (~hit[broken]).sum(axis=0)
        assert plain.evaluate(survivors, dp, pp)[0].throughput == (
            intact + int(per_stage.sum()) // pp
        ) / dp
        assert aware.evaluate(survivors, dp, pp)[0].throughput == (
            intact + int(per_stage.min())
        ) / dp
        assert unpacked.evaluate(survivors, dp, pp)[0].throughput == intact / dp
