"""The trainer's checkpoints: when a job saves and where it restarts from (`Checkpointing`),
and what one rank saves and loads of its generation (`Checkpointer`). The format itself, DCP
shards any layout reads back, is `ntp.checkpoint`'s."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from ntp.build import GenerationRank
from ntp.checkpoint import CheckpointError, CheckpointSaver, latest, load_state, save_state
from ntp.sharded_optimizer import ShardedAdamW


@dataclass(frozen=True)
class Checkpointing:
    save: Path | None = None  # the job's checkpoint directory: at the end and every `every` steps
    every: int = 0
    init: Path | None = None  # what the job started from (the fallback before any save)
    keep: int = 3
    blocking: bool = False  # write before training on (else only the copy to CPU is waited for)

    def newest(self) -> Path | None:
        """The checkpoint to restart from: the job's newest, else what it started from."""
        found = None if self.save is None else latest(self.save)
        return found or self.newest_init()

    def newest_init(self) -> Path | None:
        if self.init is None:
            return None
        found = latest(self.init)
        if found is None:
            raise CheckpointError(f"--init {self.init}: no complete checkpoint there")
        return found

    def due(self, step: int, target: int) -> bool:
        """Whether the step just done is saved: the run's last, and every `every`-th."""
        return self.save is not None and (
            step == target or bool(self.every and step % self.every == 0)
        )


class Checkpointer:
    """One rank's saves (in the background: `ntp.checkpoint.CheckpointSaver`) and loads."""

    def __init__(self, policy: Checkpointing) -> None:
        self.policy = policy
        self.saver = None if policy.save is None else CheckpointSaver(
            policy.save, policy.keep, policy.blocking
        )

    def save(self, cur: GenerationRank, step: int, samples: int) -> None:
        """Every rank stages its part (replica 0's units; the other replicas hold the same
        weights; with sharded state each rank its owned moments) and the saver writes it in
        the background; global rank 0 commits it."""
        assert self.saver is not None
        state = (
            save_state(cur.model, cur.optimizer, cur.layout.shape, cur.replica.shards,
                       cur.groups.rank)
            if cur.groups.replica == 0
            else {}
        )
        if isinstance(cur.optimizer, ShardedAdamW):
            state |= cur.optimizer.checkpoint_state()
        info = {
            "step": step,
            "samples": samples,
            "model": asdict(cur.args),
            "tp_degrees": list(cur.layout.tp_degrees),
        }
        self.saver.save(state, info, cur.groups.checkpoint, coordinator=dist.get_rank() == 0)

    def load(self, cur: GenerationRank, checkpoint: Path) -> tuple[int, int]:
        """Read this rank's units (weights and moments) of `checkpoint` into `cur`; the step
        and the data position it stands at."""
        sharded = isinstance(cur.optimizer, ShardedAdamW)
        info = load_state(checkpoint, cur.model, None if sharded else cur.optimizer,
                          cur.layout.shape, cur.shard)
        if isinstance(cur.optimizer, ShardedAdamW):
            cur.optimizer.load(checkpoint, int(info["step"]))
        return int(info["step"]), int(info["samples"])

    def wait(self) -> None:
        """Until the save in flight is committed: before the groups it uses are left."""
        if self.saver is not None:
            self.saver.wait()

    def abandon(self) -> None:
        """Forget the save in flight: its generation failed, and its collectives with it."""
        if self.saver is not None:
            self.saver.abandon()
