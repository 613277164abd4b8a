"""Trainer: one rank of a mixed-TP data-parallel job (`python -m ntp.train --layout FILE`).

The loop lives here (`Trainer`: a step's forward/backward, gradient sync, clipping and
optimizer step, across the generations the job runs), over the rank's state and its changes
of layout (`ntp.relayout.RankState`). The command line is `ntp.cli`'s.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ntp.build import GenerationRank, model_args
from ntp.checkpoint import read_args
from ntp.checkpointing import Checkpointer, Checkpointing
from ntp.cli import checkpointing_from, config_from, open_data, parse_args
from ntp.clip import clip_grad_norm_, grad_norm
from ntp.config import TrainConfig
from ntp.curves import Curves
from ntp.data import replica_rows, split_inputs
from ntp.dataset import TokenDataset
from ntp.distributed import is_communication_failure, rendezvous_from_env
from ntp.evaluation import evaluate, held_out_rows
from ntp.hf_write import keep_beside
from ntp.membership import Membership, Stranded
from ntp.model import ModelArgs, parameter_shapes
from ntp.nodeagent.progress import NodeProgress
from ntp.pipeline_train import is_pipeline, run_pipeline
from ntp.relayout import RankState
from ntp.reshard import local_state
from ntp.sources import FileGenerationSource, GenerationSource, assignment
from tessera_contracts.generation import Rendezvous
from tessera_contracts.invocation import STRANDED_EXIT
from tessera_contracts.model_shape import PlanError
from tessera_contracts.rank_events import EventKind


class GenerationEnded(RuntimeError):
    """The generation this work belonged to is over; the thread doing it was abandoned."""


# How long a training thread may take to leave a generation that ended under it before it is
# abandoned: long enough for a collective that the abort failed to return, short next to a
# step. A thread that stays (gloo's send posted on an already failed connection waits for the
# collective timeout) cannot change the job's state any more (`GenerationRank.abandoned`).
LEAVE_GRACE_S = 0.2


class Trainer(RankState):
    """One rank of the job, training across layout generations.

    Phases: `membership.join` a generation's groups; take this rank's shard (`RankState`:
    `materialize`, or `receive` it from the survivors); `train_step`s; at a step boundary a
    planned switch (`reconfigure`); after a loss `recover`; `save_checkpoint`; `finish`.

    Steps run in a thread per generation while the calling thread waits for either that thread
    or the generation's end notice: a rank learns of a loss from the notice even when its own
    collective cannot return (`LEAVE_GRACE_S`).
    """

    def __init__(
        self,
        config: TrainConfig,
        checkpointing: Checkpointing,
        source: GenerationSource,
        rendezvous: Rendezvous,
        reconfigure_timeout_s: float = 300.0,
        data: TokenDataset | None = None,
        carried: ModelArgs | None = None,
    ):
        checkpointer = Checkpointer(checkpointing)
        membership = Membership(source, rendezvous, config.device, reconfigure_timeout_s)
        super().__init__(config, checkpointer, membership, carried)
        self.data = data  # None: the synthetic sequences (ntp.data), for tests and benchmarks
        # Guards what a step changes (weights, moments, step, losses) against abandonment.
        self._lock = threading.Lock()
        self.until = 0  # the job's steps, once `run` is told them
        self.progress: NodeProgress | None = None  # this rank's own goodput ledger
        self.curves: Curves | None = None  # while this process is global rank 0

    # -- one step ------------------------------------------------------------------------------

    def local_batch(self, cur: GenerationRank) -> torch.Tensor:
        """This replica's rows of the step's global batch."""
        return replica_rows(self.data, cur.replica, self.samples, cur.layout.global_batch,
                            self.step, cur.args.vocab_size, cur.args.max_seq_len,
                            self.config.seed)

    def forward_backward(self, cur: GenerationRank, rows: torch.Tensor) -> torch.Tensor:
        """Local loss on `rows`, in micro-batches of `config.micro_batch` sequences whose
        gradients accumulate in .grad: each micro-batch's mean loss weighted by its share of the
        rows, so the sum is the whole batch's mean loss and gradient. The sync hooks start only
        in the last one's backward (the others run under `no_sync`)."""
        inputs, targets = split_inputs(rows.to(self.device))
        size = self.config.micro_batch or len(rows)
        starts = range(0, len(rows), size)
        loss = torch.zeros((), device=self.device)
        for start in starts:
            part = slice(start, start + size)
            share = len(inputs[part]) / len(rows)
            last = start == starts[-1]
            with contextlib.nullcontext() if last else cur.sync.no_sync():
                with torch.autocast(self.device.type, dtype=torch.bfloat16,
                                    enabled=self.config.precision == "bf16"):
                    logits = cur.model(inputs[part])
                micro = cur.loss_fn(logits, targets[part]) * share
                del logits  # not held through backward
                micro.backward()
            loss += micro.detach()
        return loss

    def train_step(
        self, cur: GenerationRank, on_grads: Callable[[Trainer], None] | None = None
    ) -> float:
        """One synchronized step; returns the global (full-batch) loss.

        `on_grads` sees the synchronized gradients before the optimizer uses them. The loss is
        reduced before the optimizer step, so a step is counted together with its loss record:
        a failure in any collective of the step leaves it undone, and it is redone whole.
        """
        with self.meter.phase() if self.meter else contextlib.nullcontext():
            global_loss = self._step(cur, on_grads)
        if self.meter:
            self.record.peak_bytes.append(self.meter.peaks[-1])
        return global_loss

    def _step(self, cur: GenerationRank, on_grads: Callable[[Trainer], None] | None) -> float:
        # 1. Forward and backward (the gradient hooks start the sync), the sync's tail, the
        #    global norm and the clip by it.
        t0 = self._now()
        loss = self.forward_backward(cur, self.local_batch(cur))
        t1 = self._now()
        cur.sync.finish()
        t2 = self._now()
        norm = grad_norm(cur.model, cur.layout.shape, cur.replica.shards, cur.groups.rank,
                         cur.groups.tp, world=cur.groups.world)
        if self.config.max_grad_norm is not None:
            clip_grad_norm_(cur.model, self.config.max_grad_norm, norm)
        if on_grads is not None:
            on_grads(self)
        # The schedule's rate for this step: a function of the step alone.
        rate = self.config.lr * self.config.schedule.factor(self.step, self.until)
        for group in cur.optimizer.param_groups:
            group["lr"] = rate
        # 2. The global loss, then the optimizer step, counted with it unless abandoned.
        global_loss = self.global_loss(cur, loss)
        with self._lock:
            if cur.abandoned:
                raise GenerationEnded("abandoned before the optimizer step")
            # The loss and the norm clip wait for every replica: the optimizer's own time
            # starts after them (the loss's float() has synchronized the device already).
            t_opt = self._now()
            cur.optimizer.step()
            cur.optimizer.zero_grad()
            t3 = self._now()
            times = self.record.times
            times.compute_s.append(t1 - t0)
            times.sync_s.append(t2 - t1)
            times.optimizer_s.append(t3 - t_opt)
            times.step_s.append(t3 - t0)
            self.record.losses[self.step] = global_loss
            self.record.learning_rates[self.step] = rate
            self.record.grad_norms[self.step] = float(norm)
            self.step += 1
            self.samples += cur.layout.global_batch
            self.record.step_ends[self.step] = time.time()
        return global_loss

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def global_loss(self, cur: GenerationRank, local: torch.Tensor) -> float:
        weighted = local * cur.layout.sample_weight(cur.groups.replica)
        total = weighted if cur.groups.rank == 0 else torch.zeros_like(weighted)
        dist.all_reduce(total, group=cur.groups.world)
        return float(total)

    # -- report, checkpoint and finish ---------------------------------------------------------

    def log_step(self) -> None:
        """The step just done as a JSON line on stdout, from every rank."""
        cur = self.current
        self.record.log_step(
            self.step, dist.get_rank(), self.generation, cur.layout, cur.args.max_seq_len
        )

    def log_eval(self, cur: GenerationRank) -> None:
        """The loss on the held-out split after the step just done, on every rank's output
        (a collective over the job), and on the curves."""
        samples = self.config.eval_samples
        rows = held_out_rows(cur, self.data, samples, self.config.seed)
        loss = evaluate(cur, rows, samples, self.config.micro_batch, self.device,
                        bf16=self.config.precision == "bf16")
        self.record.log_eval(self.step, dist.get_rank(), self.generation, loss, samples)
        if self.curves is not None:
            self.curves.evaluated(self.step, loss)

    def write_curves(self, cur: GenerationRank) -> None:
        """The step just done on the TensorBoard curves beside the checkpoints: written by the
        generation's global rank 0 (a process that stops being it closes its file)."""
        save = self.checkpointer.policy.save
        if save is None or dist.get_rank() != 0:
            if self.curves is not None:
                self.curves.close()
                self.curves = None
            return
        if self.curves is None:
            self.curves = Curves(save, resumed_at=self.step - 1)
        step, record = self.step, self.record
        assert self.progress is not None
        self.curves.step(
            step,
            loss=record.losses[step - 1],
            learning_rate=record.learning_rates[step - 1],
            grad_norm=record.grad_norms[step - 1],
            tokens_per_s=cur.layout.global_batch * cur.args.max_seq_len
            / record.times.step_s[-1],
            goodput=self.progress.ledger.account().goodput,
        )

    def save_checkpoint(self, cur: GenerationRank) -> None:
        self.checkpointer.save(cur, self.step, self.samples)

    def metrics(self) -> dict:
        cur = self.current
        return {
            "replica": cur.groups.replica,
            "rank": cur.groups.rank,
            "tp": cur.replica.tp,
            "local_batch": cur.replica.local_batch,
            "generation": self.generation,
            "first_generation": self.membership.first_generation,
            **self.record.to_dict(),
        }

    def finish(self) -> None:
        if self.curves is not None:
            self.curves.close()
        self.checkpointer.wait()  # the last checkpoint is committed before the job says done
        dist.barrier()
        self.membership.finish()
        dist.destroy_process_group()

    # -- the loop ------------------------------------------------------------------------------

    def run(
        self,
        until: int,
        before_step: Callable[[Trainer], None] | None = None,
        on_first_grads: Callable[[Trainer], None] | None = None,
    ) -> bool:
        """Train until the job has done `until` steps, across generations; False when this
        process leaves the job before that (no place in a later generation)."""
        first, target = self.step, until
        self.until = until  # the schedule's length: the job's steps
        if self.progress is None:
            # This rank's own goodput ledger, from its own lines, for its curves.
            self.progress = NodeProgress(f"rank {dist.get_rank()}", until)
            self.record.listeners.append(self.progress.record)
        membership = self.membership
        while self.step < target:
            # 1. This generation's steps, in a thread of their own.
            cur, outcome = self.current, []
            worker = threading.Thread(
                target=self._train_generation,
                args=(cur, target, first, before_step, on_first_grads, outcome),
                name=f"train-gen{self.generation}",
                daemon=True,
            )
            worker.start()
            # 2. Until it returns or the generation ends under it (a loss someone else saw).
            membership.wake.wait()
            if not outcome:
                reason = membership.watch.join()
                if reason.failed:
                    with self._lock:
                        cur.abandoned = True
                    worker.join(LEAVE_GRACE_S)
                    outcome.append(("failed", str(reason)))
                else:  # peers passed the same boundary first: this thread finishes it too
                    worker.join()
            kind, detail = outcome[0]
            del cur  # a relayout frees the old generation's state as it moves it
            # 3. Go on where the generation leaves the job.
            if kind == "error":
                raise detail
            # A planned switch leaves the groups a save in flight uses: it completes first. A
            # failure has broken them already.
            if kind == "switch":
                self.checkpointer.wait()
            if kind == "failed":
                self.checkpointer.abandon()
            if kind == "switch" and not self.reconfigure(detail):
                return False
            if kind == "failed" and not self.recover(detail):
                return False
        return True

    def _train_generation(
        self,
        cur: GenerationRank,
        target: int,
        first: int,
        before_step: Callable[[Trainer], None] | None,
        on_first_grads: Callable[[Trainer], None] | None,
        outcome: list,
    ) -> None:
        """Steps on `cur` until `target`, a planned switch or a failure; `outcome` says which."""
        try:
            while self.step < target:
                if before_step is not None:
                    before_step(self)
                self.train_step(cur, on_first_grads if self.step == first else None)
                # A planned change (a GPU back, a drain) may be due at this step boundary.
                following = self.membership.agreed_switch(cur.groups, self.step)
                self.log_step()
                self.write_curves(cur)
                if self.config.eval_every and (
                    self.step % self.config.eval_every == 0 or self.step == target
                ):
                    self.log_eval(cur)
                if self.checkpointer.policy.due(self.step, target):
                    self.event(EventKind.SAVING_CHECKPOINT)
                    self.save_checkpoint(cur)
                    self.event(EventKind.CHECKPOINTED)
                if following is not None:
                    self.event(EventKind.SWITCHING)
                    outcome.append(("switch", following))
                    return
            outcome.append(("done", None))
        except RuntimeError as exc:
            # A peer is gone (or this thread was abandoned): the failed step is redone on the
            # next generation's layout. Anything else is a bug and stops the rank.
            failed = isinstance(exc, GenerationEnded) or is_communication_failure(exc)
            outcome.append(("failed", repr(exc)) if failed else ("error", exc))
        except BaseException as exc:
            outcome.append(("error", exc))
        finally:
            if not cur.abandoned:
                self.membership.wake.set()


def main(
    argv: list[str] | None = None, before_step: Callable[[Trainer], None] | None = None
) -> int:
    """Run one rank (RANK, WORLD_SIZE; MASTER_ADDR/PORT for explicit layouts). `before_step`
    runs at every step boundary: failure drills hook in there, outside the training loop. A
    rank left with no generation to go on in exits with STRANDED_EXIT."""
    try:
        return _run_rank(sys.argv[1:] if argv is None else argv, before_step)
    except Stranded as exc:
        print(f"ntp.train: {exc}", file=sys.stderr, flush=True)
        return STRANDED_EXIT


def _run_rank(argv: list[str], before_step: Callable[[Trainer], None] | None) -> int:
    invocation, opts = parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # 1. The generation this process starts in, and where later ones appear (a pipeline's
    #    layout is static: ntp.pipeline_train).
    document = json.loads(invocation.layout.read_text())
    if is_pipeline(document):
        return run_pipeline(invocation, opts, document)
    first = assignment(document)
    source = FileGenerationSource(invocation.layout_dir or invocation.layout.parent)
    policy = checkpointing_from(opts)
    start_from = policy.newest() if opts.resume else policy.newest_init()
    carried = None if start_from is None else read_args(start_from)
    if opts.save is not None and start_from is not None and os.environ["RANK"] == "0":
        keep_beside(start_from, opts.save)  # the tokenizer, for the job's exports
    config = config_from(opts)
    trainer = Trainer(
        config,
        policy,
        source,
        first.rendezvous or rendezvous_from_env(),
        opts.reconfigure_timeout,
        data=open_data(opts, first.layout, carried),
        carried=carried,
    )
    # 2. Join it: build this rank's shard, or receive it from the survivors.
    rank = int(os.environ["RANK"])
    if invocation.join:
        if first.origin is None:
            raise PlanError(
                f"--join needs a generation with an origin; {invocation.layout} has none"
            )
        previous = source.get(first.generation - 1)
        if previous is None:
            raise FileNotFoundError(f"--join: generation {first.generation - 1} is not published")
        # Building on the meta device the first time imports much of torch (about a second):
        # done before the rendezvous, where every survivor would wait for it.
        parameter_shapes(model_args(config.flavor, first.layout, carried))
        joined = trainer.membership.join_formed(first, rank, first.origin)
        if joined is None:
            return 0  # the generation it came for never formed, and the next has no place
        trainer.receive(joined[0].layout, assignment(previous).layout, joined[1])
    else:
        trainer.membership.join(first, rank)
        trainer.materialize(first.layout, start_from)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)

    def dump_grads(t: Trainer) -> None:
        grads = {name: p.grad.detach().cpu() for name, p in t.model.named_parameters()}
        torch.save(grads, opts.out / f"grads-rank{dist.get_rank()}.pt")

    # 3. Train across generations.
    start = trainer.step
    until = invocation.until(start)
    dump = dump_grads if opts.dump and not invocation.join else None
    if not trainer.run(until, before_step, dump):
        return 0  # no place in the job's later layout: this GPU left it
    if opts.save is not None and until <= start and not invocation.join:
        # Nothing to train: the checkpoint is what was loaded, on this layout (every rank of
        # the first generation starts from the same state, so all of them gather it).
        trainer.save_checkpoint(trainer.current)
    # 4. Report and finish.
    if opts.out is not None:
        rank = dist.get_rank()
        (opts.out / f"rank{rank}.json").write_text(json.dumps(trainer.metrics()))
        if opts.dump:
            held = local_state(trainer.model, trainer.current.optimizer)
            state = {n: [t.cpu() for t in ts] for n, ts in held.items()}
            torch.save(state, opts.out / f"state-rank{rank}.pt")
    trainer.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
