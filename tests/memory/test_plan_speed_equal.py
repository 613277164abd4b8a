"""The memory plan's shortcuts give exactly what the straightforward count gives: each rank
planned alone (its owned state counted unit by unit), for every example job's reachable
layouts; and a relayout's sources are those its rule picks unit by unit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.model_shape import ModelShape
from tessera_core.memory import (
    _layout,
    _origin,
    layout_memory,
    plan_inputs,
    rank_memory,
    reshard_bytes,
)
from tessera_core.plan import UNIT_KINDS, JobLayout, plan_job, reshard_moves
from tessera_core.sharded_state import owned_elements, owned_elements_by_rank
from tessera_dev import paths

pytestmark = pytest.mark.memory

# The 70B's straightforward count takes tens of seconds: its shortcuts are checked on the
# smaller examples, whose layouts take every path the 70B's do (NTP-PW, sharded state or not).
EXAMPLES = [paths.repo_root() / "manifests/examples" / name
            for name in ("ntpjob-small.yaml", "ntpjob-local.yaml")]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("sharded", [False, True])
def test_each_layout_is_what_each_rank_planned_alone_gives(path: Path, sharded: bool) -> None:
    spec = NTPTrainingJobSpec.from_spec(yaml.safe_load(path.read_text())["spec"])
    job, training = plan_inputs(spec)
    training = replace(training, sharded_state=sharded)
    rule = job.mode.batch_rule
    for reachable in job.layouts():
        layout = _layout(job.shape, reachable.degrees, job.global_batch, rule)
        reshard = [] if reachable.previous is None else reshard_bytes(
            _layout(job.shape, reachable.previous, job.global_batch, rule), layout,
            _origin(reachable.previous, reachable.degrees))
        planned = {(m.replica, m.rank): m for m in layout_memory(job, reachable, training).ranks}
        for (replica, rank), memory in planned.items():
            alone = rank_memory(layout, replica, rank, training)
            if reshard:
                alone = replace(alone, reshard=reshard[layout.replicas[replica]
                                                       .global_rank(rank)])
            assert memory == alone, (reachable.name, replica, rank)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_owned_state_counted_in_one_pass_is_each_ranks_own_count(path: Path) -> None:
    spec = NTPTrainingJobSpec.from_spec(yaml.safe_load(path.read_text())["spec"])
    job, _ = plan_inputs(spec)
    for reachable in job.layouts():
        layout = _layout(job.shape, reachable.degrees, job.global_batch, job.mode.batch_rule)
        assert owned_elements_by_rank(layout) == {
            (rep.index, j): owned_elements(layout, rep.index, j)
            for rep in layout.replicas for j in range(rep.tp)}


def _moves_by_the_rule(old: JobLayout, new: JobLayout, origin: list[int | None]
                       ) -> list[dict[int, dict[str, list[int]]]]:
    """reshard_moves' rule, unit by unit: each new rank in order takes each unit it lacks
    (kind by kind, unit order) from the holder that is in its own old replica first, least
    loaded next, lowest rank last."""
    old_of = {rep.global_rank(j): (rep.index, shard) for rep in old.replicas
              for j, shard in enumerate(rep.shards)}
    load = {o: 0 for o in origin if o is not None}
    out = []
    for d, me in enumerate(origin):
        replica, rank = new.locate(d)
        shard = new.replicas[replica].shards[rank]
        got: dict[int, dict[str, list[int]]] = {}
        for kind in UNIT_KINDS:
            held = () if me is None else old_of[me][1].units(kind)
            for u in shard.units(kind):
                if u in held:
                    got.setdefault(d, {}).setdefault(kind, []).append(u)
                    continue
                src = min((o for o in load if u in old_of[o][1].units(kind)), key=lambda o: (
                    me is None or old_of[o][0] != old_of[me][0], load[o], o))
                load[src] += 1
                got.setdefault(origin.index(src), {}).setdefault(kind, []).append(u)
        out.append(got)
    return out


@pytest.mark.parametrize(("before", "after"), [((4, 4), (3, 4)), ((3, 4), (4, 4)),
                                                ((4, 3), (3, 3)), ((4, 4, 4), (3, 2, 4))])
def test_relayout_sources_follow_the_rule(before: tuple[int, ...], after: tuple[int, ...]
                                          ) -> None:
    shape = ModelShape(hidden=96, n_heads=12, n_kv_heads=4, ffn=40, vocab=64, n_layers=2,
                       seq_len=16)
    old, new = plan_job(shape, before, 24), plan_job(shape, after, 24)
    origin = _origin(before, after)
    moves = reshard_moves(old, new, origin)
    assert [{s: {k: list(v) for k, v in piece.to_dict().items() if v} | (
        {"kv_heads": list(piece.kv_heads)} if piece.kv_heads else {})
        for s, piece in enumerate(row) if not piece.is_empty()} for row in moves] \
        == _moves_by_the_rule(old, new, origin)
