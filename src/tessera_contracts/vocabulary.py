"""The words every process uses alike (docs/glossary.md defines them): a trainer's phases and
the badput categories they make, the failure policies."""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """What the trainer is doing; every instant of its life is in exactly one phase."""

    STARTUP = "startup"  # process start, rendezvous, model build: before the first step
    TRAINING = "training"
    RECONFIGURATION = "reconfiguration"  # live relayout: new groups, resharding
    RESTART = "restart"  # recovery by a process restart (from the failure to the resumed run)
    CHECKPOINT_SAVE = "checkpoint_save"
    CHECKPOINT_RESTORE = "checkpoint_restore"
    WAITING_FOR_HEALTH = "waiting_for_health"  # no usable layout: too few healthy GPUs
    OTHER = "other"  # anything else the trainer does between steps (evaluation, logging)


LOST_PROGRESS = "lost_progress"
# Badput categories: every phase but training, and the training time that did not count.
BADPUT_CATEGORIES: tuple[str, ...] = tuple(
    p.value for p in Phase if p is not Phase.TRAINING) + (LOST_PROGRESS,)


class FailurePolicy(StrEnum):
    """What a job does with a data-parallel replica that lost a GPU (`spec.failurePolicy.mode`);
    the simulator compares the same policies."""

    NTP = "NTP"  # the replica trains on at a reduced TP degree
    NTP_PW = "NTP-PW"  # ... and the survivors of its scale-up domain get power to keep pace
    DROP = "DROP"  # the replica sits out until its GPUs are back
    SPARE = "SPARE"  # a spare scale-up domain stands in for it
    CKPT_RESTART = "CKPT-RESTART"  # every trainer pod replaced, resumed from the checkpoint

    @property
    def reshapes(self) -> bool:
        """Whether a replica that lost GPUs trains on at a reduced TP degree."""
        return self in (FailurePolicy.NTP, FailurePolicy.NTP_PW)

    @property
    def restarts_on_loss(self) -> bool:
        """Whether a GPU lost under the layout ends the attempt (every trainer pod replaced,
        the job resumed from its last checkpoint) instead of a live relayout."""
        return self is FailurePolicy.CKPT_RESTART

    @property
    def batch_rule(self) -> str:
        """How the global batch is split (tessera_core.plan): only NTP-PW gives every replica
        the same batch (its reduced replicas keep pace through power); the others give
        replicas samples in proportion to their TP degree (DROP, SPARE and CKPT-RESTART run
        every replica at full TP, where both rules agree)."""
        return "ntp-pw" if self is FailurePolicy.NTP_PW else "ntp"
