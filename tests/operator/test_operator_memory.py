"""The operator's memory grows with what it acts on, not with the cluster's nodes: the same
jobs running beside N and then 4N simulated nodes, its resident memory differs by less than
`GROWTH_BOUND_MIB`."""

from __future__ import annotations

import copy
import uuid

import pytest
import yaml
from opharness import ROOT, RunningOperator

from tessera_dev import opbench, simnodes

pytestmark = pytest.mark.operator

EXAMPLE = yaml.safe_load((ROOT / "manifests/examples/ntpjob-small.yaml").read_text())
NODES = 250  # N; 4N once the jobs run
JOBS, JOB_NODES = 4, 2
# 3N more nodes may cost at most 8 KiB each (5.9 MiB): at that rate 8,192 nodes cost 64 MiB, a
# quarter of the 256 MiB the operator is to stay under at the paper's scale
# (operator/tessera_operator/README.md, `tessera-dev bench operator`). Each node is kept as a few
# small values (`cache.NodeFacts`) and kopf's record of the object; a node body kept per node,
# about 5 KiB of JSON and several times that as Python objects, would exceed it.
GROWTH_BOUND_MIB = 3 * NODES * 8 / 1024
IDLE_TIMEOUT_S = 300.0


def _settled_rss(op: RunningOperator) -> float:
    """RSS once the operator has worked off the watch events queued so far."""
    opbench.wait_idle(op.proc.pid, IDLE_TIMEOUT_S)
    return opbench.rss_mib(op.proc.pid)


def test_memory_does_not_grow_with_the_nodes_no_job_uses(running_operator) -> None:
    op = running_operator
    tag = uuid.uuid4().hex[:6]
    groups = {f"mem-{tag}-{j}": [f"mem-{tag}-{j}-{k}" for k in range(JOB_NODES)]
              for j in range(JOBS)}
    idle = [f"mem-{tag}-idle-{i}" for i in range(4 * NODES)]
    opbench.create_nodes(op.admin, groups | {f"mem-{tag}-idle": idle[:NODES - JOBS * JOB_NODES]})
    for name in groups:
        job = copy.deepcopy(EXAMPLE)
        job["metadata"] = {"name": name}
        simnodes.place_in_pool(job["spec"], name)
        op.create_job(job)
    healthy = ",".join(["8"] * JOB_NODES)
    for name in groups:
        op.wait(lambda name=name: op.status(name).get("tpLayout"), lambda t: t == healthy,
                f"job {name} planned")
    at_n = _settled_rss(op)
    opbench.create_nodes(op.admin, {f"mem-{tag}-idle": idle[NODES - JOBS * JOB_NODES:
                                                             4 * NODES - JOBS * JOB_NODES]})
    at_4n = _settled_rss(op)
    print(f"\noperator RSS beside {NODES} nodes {at_n:.1f} MiB, beside {4 * NODES} "
          f"{at_4n:.1f} MiB: {(at_4n - at_n) * 1024 / (3 * NODES):.1f} KiB a node")
    assert at_4n - at_n < GROWTH_BOUND_MIB, (
        f"operator RSS {at_n:.1f} MiB beside {NODES} nodes, {at_4n:.1f} MiB beside "
        f"{4 * NODES}: {at_4n - at_n:.1f} MiB more, bound {GROWTH_BOUND_MIB:.1f} MiB")
