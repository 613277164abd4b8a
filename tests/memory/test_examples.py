"""Every example job is one the API server stores and passes its own plan (`tessera plan`) on
the GPUs it names, docs/memory.md shows that plan's table, and the 70B example fits its GPUs
only with its optimizer state sharded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tessera_cli import plan
from tessera_dev import paths

pytestmark = pytest.mark.memory

ROOT = paths.repo_root()
EXAMPLES = sorted((ROOT / "manifests/examples").glob("*.yaml"))
MEMORY_DOC = ROOT / "docs/memory.md"


def _table(printed: str) -> str:
    """The per-GPU table `tessera plan` printed: from its header to the blank line."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout  rank"))
    end = lines.index("", start)
    return "\n".join(lines[start:end])


def test_the_api_server_stores_every_example(admin_api: client.ApiClient, namespace: str,
                                             tessera_crds: list[str]) -> None:
    jobs = client.CustomObjectsApi(admin_api)
    for path in EXAMPLES:
        (job,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
        group, version = job["apiVersion"].split("/")
        # Strict, like kubectl: a misspelt field is an error rather than silently dropped
        stored = jobs.create_namespaced_custom_object(
            group, version, namespace, "ntptrainingjobs", job, dry_run="All",
            field_validation="Strict")
        assert stored["spec"]["gpuMemory"] == job["spec"]["gpuMemory"], path.name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_fits_the_gpus_it_names_down_to_its_minimum_tp(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (job,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    spec = job["spec"]
    assert "gpuMemory" in spec, "an example names the memory of the GPUs it is written for"
    assert plan.main([str(path)]) == 0
    printed = capsys.readouterr().out
    minimum = spec["failurePolicy"]["minTensorParallelSize"]
    assert f"every reachable layout fits down to TP {minimum}:" in printed, printed
    assert _table(printed) in MEMORY_DOC.read_text(), \
        f"docs/memory.md lacks {path.name}'s table as `tessera plan` prints it:\n{printed}"


def test_the_70b_example_does_not_fit_without_its_optimizer_state_sharded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = yaml.safe_load((ROOT / "manifests/examples/ntpjob-70b.yaml").read_text())
    job["spec"]["optimizer"]["shardedState"] = False
    unsharded = tmp_path / "unsharded.yaml"
    unsharded.write_text(yaml.safe_dump(job))
    assert plan.main([str(unsharded)]) == 1
    printed = capsys.readouterr().out
    assert "does not fit: layout 8x8 needs" in printed, printed
    # AdamW's two fp32 moments of a TP8 rank's eighth of Llama 3 70B's 70.55 billion
    # parameters (its norms, replicated, are 0.002% of them)
    optimizer = next(line for line in printed.splitlines() if line.startswith("8x8 "))
    assert float(optimizer.split()[7]) == pytest.approx(8 * 70.55e9 / 8 / 2**30, rel=0.01)
