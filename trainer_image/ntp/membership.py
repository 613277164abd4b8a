"""Which generation this process is in and how it moves between them: joining a generation's
groups (watched for its end), the switch every rank agrees on at a step boundary, the next
generation after a failure, and leaving the old groups.

What moves with a process between two layouts is `ntp.reshard`'s; the `Trainer` decides when.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import torch.distributed as dist

from ntp.distributed import (
    End,
    EndReason,
    FailureWatch,
    RendezvousEnded,
    abort_in_flight,
    connect,
    end_generation,
    init_distributed,
    leave_process_groups,
    ready_to_form,
    register_process,
)
from ntp.groups import JobGroups
from ntp.sources import Assignment, GenerationSource, assignment, at_step_of, wait_for
from tessera_contracts.generation import Rendezvous
from tessera_contracts.model_shape import PlanError


class Stranded(RuntimeError):
    """A generation failed and no later one was published in time: nobody plans the job's next
    layout (the rank exits with STRANDED_EXIT)."""


class Membership:
    """This process's place in the job's generations, on the job's store.

    `wake` is set when the generation ends (its `FailureWatch`) or its training thread
    returns; both are replaced at every `join`.
    """

    def __init__(
        self,
        source: GenerationSource,
        rendezvous: Rendezvous,
        device: str,
        reconfigure_timeout_s: float = 300.0,
    ):
        self.source = source
        self.rendezvous = rendezvous
        self.device = device
        self.reconfigure_timeout_s = reconfigure_timeout_s
        self.store = connect(rendezvous)
        self.generation = -1
        self.first_generation: int | None = None  # the one this process started in

    def join(self, target: Assignment, rank: int) -> None:
        """Rendezvous as global rank `rank` of `target`'s generation, watched for its end."""
        register_process(self.store, target.generation)
        init_distributed(self.device, self.store, rank, target.layout.world_size,
                         target.generation)
        self.generation = target.generation
        if self.first_generation is None:
            self.first_generation = target.generation
        self.wake = threading.Event()  # the generation ended, or its training thread returned
        self.watch = FailureWatch(
            self.rendezvous, target.generation, self._abort_in_flight, self.wake.set
        )

    def join_formed(
        self, target: Assignment, rank: int, origin: Sequence[int | None]
    ) -> tuple[Assignment, tuple[int | None, ...]] | None:
        """Join `target` as `rank`; while the generation to join ends before it forms (a
        process it counts on died first), the next one instead, where this process has a place.
        `origin[d]`: the rank, in the layout this process holds, of the process that becomes
        `target`'s rank d. Returns the generation joined and its origin in that held layout
        (through every generation that never formed); None when this process has no place."""
        while True:
            try:
                self.join(target, rank)
                return target, tuple(origin)
            except RendezvousEnded as exc:
                print(f"rank {rank} of generation {target.generation}: {exc}", file=sys.stderr,
                      flush=True)
                following = wait_for(self.source, target.generation + 1,
                                     self.reconfigure_timeout_s)
                if following is None:
                    raise Stranded(
                        f"{exc}; no generation {target.generation + 1} appeared within "
                        f"{self.reconfigure_timeout_s:.0f} s") from None
                if following.origin is None:
                    raise PlanError(f"generation {following.generation} has no origin") from None
            if rank not in following.origin:
                return None
            origin = tuple(None if o is None else origin[o] for o in following.origin)
            target, rank = following, following.origin.index(rank)

    def _abort_in_flight(self) -> None:
        abort_in_flight(self.device, self.rendezvous.port)

    def agreed_switch(self, groups: JobGroups, step: int) -> Assignment | None:
        """The next generation if it is planned for this step boundary, as rank 0 read it: at or
        after its step (the operator plans from progress reports, which lag the ranks), once the
        processes it adds have come to its rendezvous (until then the ranks train on).

        One reader decides for everyone (a broadcast on the job's world group): ranks reading
        the source themselves could disagree when it is published while they pass the boundary.
        """
        box: list = [None]
        if groups.replica == 0 and groups.rank == 0:
            document = self.source.get(self.generation + 1)
            planned = None if document is None else at_step_of(document)
            if planned is not None and planned <= step:
                joiners = sum(o is None for o in document.get("origin") or ())
                if ready_to_form(self.store, self.generation + 1, joiners):
                    box[0] = document
        dist.broadcast_object_list(box, src=0, group=groups.world)
        return None if box[0] is None else assignment(box[0])

    def after_failure(self, error: str) -> Assignment:
        """End the failed generation (if nobody has), once its watch has aborted what was in
        flight, and wait for the next one; Stranded when none comes in time."""
        end_generation(
            self.store, self.generation, EndReason(End.FAILED, f"rank {dist.get_rank()}: {error}")
        )
        self.watch.join()  # its abort has failed whatever was still in flight
        following = wait_for(self.source, self.generation + 1, self.reconfigure_timeout_s)
        if following is None:
            raise Stranded(
                f"generation {self.generation} failed and no generation {self.generation + 1} "
                f"appeared within {self.reconfigure_timeout_s:.0f} s: {error}"
            )
        return following

    def leave(self, following: Assignment, rank: int) -> bool:
        """Leave this generation for `following` (global rank `rank` here); True when this
        process has a place in it (it then counts in `following`'s processes)."""
        assert following.origin is not None
        # 1. Where this process goes.
        stays = rank in following.origin
        if stays:
            register_process(self.store, following.generation)
        # 2. The old generation is over for everyone once anyone joins the next one; its watch
        #    stops (a failure already ended it, and the watch aborted what was in flight).
        end_generation(self.store, self.generation, EndReason(End.SUPERSEDED))
        self.watch.join()
        # 3. Leave the old groups; only an abandoned thread may still hold them.
        leave_process_groups()
        return stays

    def finish(self) -> None:
        """The job's last step is done: its generation ends as finished."""
        end_generation(self.store, self.generation, EndReason(End.FINISHED))
        self.watch.join()
