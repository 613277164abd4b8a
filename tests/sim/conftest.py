"""Fixtures for the simulator tests: the paper's default job and its six policies, built once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from tessera_sim.config import SimConfig
from tessera_sim.engine import snapshot
from tessera_sim.failures import Topology
from tessera_sim.policies import POLICY_NAMES, Policy, build_policies


@dataclass(frozen=True)
class Snapshot:
    """Mean outcomes per policy over random draws with a fixed number of failed GPUs."""

    # The share actually failed: the requested one rounded to whole failed GPUs.
    failed: float
    loss: dict[str, float]
    # Missing throughput in TP-group equivalents (see policies.Capacity.deficit_groups).
    deficit: dict[str, float]
    # Standard error of each mean, for tolerances of a few sigma.
    loss_se: dict[str, float]
    deficit_se: dict[str, float]


@pytest.fixture(scope="session")
def paper_config() -> SimConfig:
    return SimConfig().validate()


@pytest.fixture(scope="session")
def paper_policies(paper_config: SimConfig) -> tuple[Policy, ...]:
    return build_policies(paper_config)


@pytest.fixture(scope="session")
def paper_snapshot(paper_config: SimConfig, paper_policies: tuple[Policy, ...]):
    """paper_snapshot(fraction) -> Snapshot over 24 draws for the paper job."""
    topo = Topology.of(paper_config)
    cache: dict[float, Snapshot] = {}

    def at(fraction: float) -> Snapshot:
        if fraction not in cache:
            rng = np.random.default_rng(round(fraction * 1e6))
            blocks = topo.blocks_for(fraction)
            draws = snapshot(paper_config, topo, paper_policies, blocks, 24, rng)

            def by_policy(values: np.ndarray) -> dict[str, float]:
                return dict(zip(POLICY_NAMES, values.tolist(), strict=True))

            loss, deficit = 1.0 - draws["throughput"], draws["deficit_groups"]
            n = len(loss)
            cache[fraction] = Snapshot(
                topo.failed_share(blocks),
                by_policy(loss.mean(axis=0)),
                by_policy(deficit.mean(axis=0)),
                by_policy(loss.std(axis=0, ddof=1) / np.sqrt(n)),
                by_policy(deficit.std(axis=0, ddof=1) / np.sqrt(n)),
            )
        return cache[fraction]

    return at
