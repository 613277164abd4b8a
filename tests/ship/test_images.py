"""Each image's constraints file (constraints/<extra>.txt, from `tessera-dev lock`) pins its whole
environment: pyproject.toml's direct pins, and every distribution they pull in at a version their
requirements accept. Checked offline against the dependency metadata of the project's own
environment, which holds every distribution the images do; the operator and the power agent pull
in no torch."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tessera_dev import lock

pytestmark = pytest.mark.ship

REPO = Path(__file__).resolve().parents[2]
EXTRAS = sorted(set(lock.IMAGES.values()))


def pinned(extra: str) -> dict[str, str]:
    return lock.pins(lock.constraints_path(extra, REPO).read_text())


def closure(wanted: list[str]) -> tuple[set[str], list[tuple[Requirement, str]]]:
    """Every distribution `wanted` pulls in on this interpreter, by the installed metadata of
    this environment, and each requirement met on the way with the distribution that asked."""
    seen: set[str] = set()
    met: list[tuple[Requirement, str]] = []
    todo = [(Requirement(line), "pyproject.toml") for line in wanted]
    while todo:
        requirement, asked_by = todo.pop()
        met.append((requirement, asked_by))
        name = lock.canonical(requirement.name)
        key = f"{name}[{','.join(sorted(requirement.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        dist = importlib.metadata.distribution(name)
        for line in dist.requires or []:
            nested = Requirement(line)
            wanted_here = nested.marker is None or any(
                nested.marker.evaluate({"extra": extra})
                for extra in (requirement.extras or {""}))
            if wanted_here:
                todo.append((nested, name))
    return {key.partition("[")[0] for key in seen}, met


@pytest.mark.parametrize("extra", EXTRAS)
def test_the_direct_pins_are_pyprojects(extra: str) -> None:
    pins = pinned(extra)
    for line in lock.requirements(extra, REPO):
        requirement = Requirement(line)
        [spec] = requirement.specifier
        assert spec.operator == "==", f"pyproject.toml pins exactly: {line}"
        assert pins.get(lock.canonical(requirement.name)) == spec.version, (
            f"constraints/{extra}.txt pins {requirement.name} at "
            f"{pins.get(lock.canonical(requirement.name))}, pyproject.toml at {spec.version}: "
            "run `tessera-dev lock`")


@pytest.mark.parametrize("extra", EXTRAS)
def test_every_distribution_pulled_in_is_pinned_at_a_version_it_may_have(extra: str) -> None:
    pins = pinned(extra)
    needed, met = closure(lock.requirements(extra, REPO))
    assert needed - pins.keys() == set(), f"unpinned in constraints/{extra}.txt"
    assert pins.keys() - needed == set(), f"pinned but not needed in constraints/{extra}.txt"
    refused = [f"{asked_by} needs {requirement}, pinned {pins[lock.canonical(requirement.name)]}"
               for requirement, asked_by in met
               if not requirement.specifier.contains(pins[lock.canonical(requirement.name)],
                                                     prereleases=True)]
    assert refused == [], f"constraints/{extra}.txt: run `tessera-dev lock`"


@pytest.mark.parametrize("extra", ["operator", "agent"])
def test_the_operator_and_agent_environments_carry_no_torch(extra: str) -> None:
    assert set(lock.HEAVY) & pinned(extra).keys() == set()
    # nor the CUDA libraries that come with it
    assert [name for name in pinned(extra)
            if name.startswith(("nvidia-cu", "cuda-"))] == []


def test_the_trainer_environment_carries_cuda_through_torchs_wheels() -> None:
    pins = pinned("trainer")
    assert {"torch", "triton"} <= pins.keys()
    for library in ("nvidia-cuda-runtime", "nvidia-cudnn", "nvidia-nccl"):
        assert any(name.startswith(library) for name in pins), library
