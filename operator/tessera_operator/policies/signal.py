"""The signal policy (pure): a job's GPU health from the sources its spec names, merged.

`failurePolicy.healthSources` chooses among the administrative cordons (`cordon`), DCGM's
GPUHealth (`dcgm`) and DRA's device taints and resource health (`dra`: `dra_health`); the nodes
the job lost and the ranks its node agents saw die count whatever it chooses, as failures under
the processes rather than drains. A node its agents report silent is lost only on evidence that
does not rest on one pod's report (`health.heard_silent`). GPUs of unknown health are held where
the generation in force has them (`health.hold_unknown`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_operator import dra_health, health, workload
from tessera_operator.observed import Observed


def health_of(spec: NTPTrainingJobSpec, observed: Observed, placement: Mapping[int, str],
              nodes: tuple[Mapping[str, Any], ...], now: datetime | None
              ) -> tuple[health.Health, health.Health]:
    """The health of the job's GPUs on `nodes` from its sources, merged, and the part lost
    under their processes rather than drained: the GPUs of nodes that stopped reporting (their
    kubelet, or their node agent to the job's other agents), those whose rank the node agents
    saw die, those DCGM failed (`now` None: without the last two, which need the time), and
    those under a NoExecute device taint or that their pod reports Unhealthy."""
    policy = spec.failure_policy
    sources = set(policy.health_sources)
    placed = sorted(set(placement.values()))
    reports = observed.reports_of(placed)
    silence = health.heard_silent(reports, None if now is None else now.timestamp())
    lost = health.from_lost_nodes(nodes, spec.gpus_per_node, placed=placed,
                                  leaving=workload.leaving_nodes(observed.pods, observed.job),
                                  silent=silence.nodes)
    lost = lost.merge(health.Health(problems=silence.problems, recheck_at=silence.recheck_at))
    signal = health.from_cordons(nodes, spec.gpus_per_node) if "cordon" in sources \
        else health.Health()
    if "dra" in sources:
        tainted, under = dra_health.from_device_taints(
            observed.devices, [n["metadata"]["name"] for n in nodes], spec.gpus_per_node)
        unhealthy = dra_health.from_resource_health(
            workload.trainer_pods(observed.pods, observed.job), spec.gpus_per_node)
        lost = lost.merge(under).merge(unhealthy)
        signal = signal.merge(tainted)
    if now is None:
        return signal.merge(lost), lost
    names = sorted({n["metadata"]["name"] for n in nodes})
    published = sorted((o for o in observed.gpu_health if o.node in set(names)),
                       key=lambda o: o.node or "")
    dcgm = "dcgm" in sources
    lost = lost.merge(health.from_rank_deaths(
        reports, spec.gpus_per_node, now=now.timestamp(),
        told_at=health.observed_at(published) if dcgm else None,
        settled=policy.mode.restarts_on_loss, hold_s=float(policy.rank_death_hold_seconds)))
    signal = signal.merge(lost)
    if not dcgm:
        return signal, lost
    dcgm_health = health.from_gpu_health(published, spec.gpus_per_node, policy.fatal_xids,
                                         now=now.timestamp(), nodes=names)
    in_force = observed.layout.generation
    kept = None if in_force is None else [(g.node, g.index) for g in in_force.gpus]
    reporting = [o.node for o in published if o.node is not None]
    return health.hold_unknown(signal.merge(dcgm_health), kept, reporting), \
        lost.merge(dcgm_health)
