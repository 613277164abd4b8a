"""The memory plan's shortcuts give exactly what the straightforward count gives: each rank
planned alone (its owned state counted unit by unit), for every example job's reachable
layouts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_core.memory import (
    _layout,
    _origin,
    layout_memory,
    plan_inputs,
    rank_memory,
    reshard_bytes,
)
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
