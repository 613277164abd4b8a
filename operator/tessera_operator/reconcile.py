"""Reconcile one NTPTrainingJob from its name and the world as observed, level-triggered.

Every trigger runs the same `reconcile`, which never asks which event arrived, in the steps of
controller-runtime's reconcilers: observe (`observe`, reads only; the job's spec typed and its
inputs parsed once, here) -> decide the desired state once (`desired`, a pure function of the
spec, the observation and the clock) -> act idempotently (`apply`: deterministic child names,
writes only where the world differs), what the API server refuses written into the decision
(`Desired.pods_rejected`, `Desired.power_refused`) rather than deciding again -> the status
rebuilt from the world, with Conditions and one event per decision (a status the API server
refuses is said in Ready and an event, not retried in a loop). A job waiting for something
(a rendezvous address, an agent's report) is brought back by that thing's watch event
(`handlers`), and the resync catches up with anything missed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import kopf

from tessera_contracts.powertarget import format_time
from tessera_operator import apply, conditions, desired, metrics, observe
from tessera_operator.jobqueue import JobKey
from tessera_operator.observed import ours
from tessera_operator.planner import Problem
from tessera_operator.policies import placement, queueing

# Watches drive every change; the resync only re-observes what a watch may have missed. Its
# cost is five reads per job per interval, whatever the number of nodes.
RESYNC_INTERVAL_S = 300.0
# A placement that read the node cache while node events changed it places again this soon:
# the event's own reconcile may have run before this job was known to need nodes.
REPLACE_AFTER_S = 1.0


def reconcile(memo: kopf.Memo, key: JobKey, logger: logging.Logger,
              indices: observe.Indices) -> float | None:
    """Bring the job's children, layout, power targets and status in line with the world;
    returns in how many seconds the job wants its next reconcile (its resync, or its TTL
    sooner), None once it is gone or not ours."""
    api, queue = memo.api, memo.queue
    with queue.running(key):
        now = memo.clock()
        # 1. Observe the job (gone: keep nothing of it; being deleted: the garbage collector
        #    takes its children, the deletion's event its power targets; another
        #    controller's: leave it), then its world.
        job = observe.job(api, key)
        if job is None:
            queue.forget(key)
            memo.status_refused.pop(key, None)
            return None
        if job["metadata"].get("deletionTimestamp") or not ours(job):
            return None
        queue.hold(key, True)  # an agent's report made once the targets are read is not lost
        observed = observe.world(api, memo.nodes, indices, job)
        # 2. Decide, once, and make the children. A job that lacks a trainer pod is placed one
        #    at a time: another job's placement, listing the pods before this one's exist,
        #    would choose the same free GPUs (and its pods would stay Pending). An attempt
        #    that ends writes its status (its account) before its pods and reports go; pods
        #    the API server refuses leave the job without a plan. A queued job runs the spec
        #    its queue lets it (held suspended, or with its admission's flavor).
        spec = desired.job_spec(job)
        queued = None if isinstance(spec, Problem) else \
            queueing.decide(spec, observed, format_time(now))
        if queued is not None:
            spec = queued.spec
        placing = placement.needs_placement(spec, observed, now)
        nodes_seen = memo.nodes.changes
        with memo.placing if placing else contextlib.nullcontext():
            if placing:
                observed = observe.with_candidates(
                    api, memo.nodes, indices, observed, placement.selector(spec),
                    lambda seen: placement.chosen_nodes(spec, seen))
            wanted = desired.desired(spec, observed, now, queued)
            if wanted.ended and not _status(memo, key, job, wanted, now, logger):
                return RESYNC_INTERVAL_S  # its account is not recorded: nothing is deleted
            apply.leftovers(api, job, wanted)
            rejected = apply.children(api, observed, wanted)
            if rejected is not None:
                wanted = wanted.pods_rejected(rejected)
        apply.queue(api, observed, wanted, logger)
        queue.wait_for_nodes(key, wanted.waits_for_nodes)
        if wanted.delete_job:
            apply.delete_job(api, job)
            return None
        # 3. The generation document, then the power targets. Without a plan nothing asks for
        #    power any more: the job's targets are released, never left boosted.
        if wanted.layout is not None:
            apply.layout(api, wanted.layout, wanted.layout_version)
            metrics.LAYOUT_GENERATIONS.inc()
        refused = apply.power(api, observed, wanted)
        if refused is not None:
            wanted = wanted.power_refused(refused)
        queue.hold(key, bool(wanted.held))
        # 4. The status, written when it differs; an event per decision.
        if not wanted.ended:
            _status(memo, key, job, wanted, now, logger)
        apply.events(job, wanted.events, logger)
        if placing and memo.nodes.changes != nodes_seen:
            return REPLACE_AFTER_S
        return min(wanted.requeue_after or RESYNC_INTERVAL_S, RESYNC_INTERVAL_S)


def _status(memo: kopf.Memo, key: JobKey, job: Mapping[str, Any], wanted: desired.Desired,
            now: datetime, logger: logging.Logger) -> bool:
    """Write the job's status; False when the API server refused it as invalid. A refusal is
    logged, said in Ready over the status the server last took (`conditions.refused`; that
    write refused too, it is said no more there) and in a Warning event with the server's
    message, once per message: the same status would be refused again, so the write waits
    for the next change the watches bring (or the resync) instead of a retry in a loop."""
    refused = apply.status(memo.api, job, wanted.status)
    said: dict[JobKey, str] = memo.status_refused
    if refused is None:
        said.pop(key, None)
        return True
    logger.warning(f"job {key[0]}/{key[1]}: status refused by the API server: {refused}")
    generation = int(job["metadata"].get("generation", 0))
    if apply.status(memo.api, job, conditions.refused(
            job.get("status") or {}, refused, format_time(now), generation)) is not None:
        logger.warning(f"job {key[0]}/{key[1]}: its Ready condition refused too")
    if said.get(key) != refused:
        said[key] = refused
        apply.events(job, (desired.Event("Warning", "StatusRefused", (
            f"the API server refused the job's status, which stays as it was: {refused}")),),
            logger)
    return False
