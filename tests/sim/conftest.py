"""Fixtures for the simulator tests: the paper's default job and its six policies, built once."""

from __future__ import annotations

import numpy as np
import pytest
from tessera_operator.simulator.config import SimConfig
from tessera_operator.simulator.engine import snapshot
from tessera_operator.simulator.failures import Topology
from tessera_operator.simulator.policies import POLICY_NAMES, Policy, build_policies


@pytest.fixture(scope="session")
def paper_config() -> SimConfig:
    return SimConfig().validate()


@pytest.fixture(scope="session")
def paper_policies(paper_config: SimConfig) -> tuple[Policy, ...]:
    return build_policies(paper_config)


@pytest.fixture(scope="session")
def mean_loss(paper_config: SimConfig, paper_policies: tuple[Policy, ...]):
    """mean_loss(fraction) -> {policy: mean throughput loss over 24 draws} for the paper job."""
    topo = Topology.of(paper_config)
    cache: dict[float, dict[str, float]] = {}

    def at(fraction: float) -> dict[str, float]:
        if fraction not in cache:
            rng = np.random.default_rng(round(fraction * 1e6))
            draws = snapshot(paper_config, topo, paper_policies, fraction, 24, rng)
            loss = 1.0 - draws["throughput"].mean(axis=0)
            cache[fraction] = dict(zip(POLICY_NAMES, loss.tolist(), strict=True))
        return cache[fraction]

    return at
