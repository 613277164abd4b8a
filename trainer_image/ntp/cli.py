"""The trainer's command line (`python -m ntp.train`): the rank's invocation, which its node
agent writes (tessera_contracts.invocation), the trainer's own options, and what they configure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ntp.build import model_args
from ntp.checkpointing import Checkpointing
from ntp.config import TrainConfig
from ntp.dataset import TokenDataset
from ntp.distributed import pick_device
from ntp.grad_sync import DEFAULT_BUCKET_ELEMENTS
from ntp.model import FLAVORS, ModelArgs
from ntp.recipe import SCHEDULES, Schedule
from tessera_contracts.invocation import InvocationError, RankInvocation, rank_help
from tessera_contracts.jobspec import schema_default
from tessera_core.memory import CHECKPOINTING
from tessera_core.plan import JobLayout

DESCRIPTION = (
    "Trainer: one rank of a mixed-TP data-parallel job (`python -m ntp.train --layout FILE`)."
)


def parse_args(argv: list[str]) -> tuple[RankInvocation, argparse.Namespace]:
    """The rank's invocation (what its node agent sets: tessera_contracts.invocation) and the
    trainer's own options."""
    parser = argparse.ArgumentParser(
        prog="ntp.train",
        description=DESCRIPTION,
        epilog=rank_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--flavor", choices=sorted(FLAVORS), help="a named model (default: the layout's shape)"
    )
    parser.add_argument("--lr", type=float, default=schema_default("optimizer.learningRate"),
                        help="the peak learning rate")
    parser.add_argument("--weight-decay", type=float,
                        default=schema_default("optimizer.weightDecay"),
                        help="AdamW's weight decay, on the matrices but the token embedding")
    parser.add_argument("--weight-decay-all", action="store_true",
                        help="decay norm gains, biases and the embedding too")
    parser.add_argument("--lr-schedule", choices=SCHEDULES,
                        default=schema_default("optimizer.schedule.type"),
                        help="after the warmup: constant, cosine to --min-lr-ratio at the last "
                        "step, or wsd (the peak until the last --decay-steps, then linearly down)")
    parser.add_argument("--warmup-steps", type=int,
                        default=schema_default("optimizer.schedule.warmupSteps"))
    parser.add_argument("--decay-steps", type=int,
                        default=schema_default("optimizer.schedule.decaySteps"))
    parser.add_argument("--min-lr-ratio", type=float,
                        default=schema_default("optimizer.schedule.minRatio"))
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="the loss on a held-out split every N steps and after the last")
    parser.add_argument("--eval-samples", type=int, default=schema_default("eval.samples"),
                        metavar="N", help="sequences in the held-out split (with --data: the "
                        "dataset's last N windows, never trained on)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-elements", type=int, default=DEFAULT_BUCKET_ELEMENTS)
    parser.add_argument("--max-grad-norm", type=float, help="clip by the global gradient norm")
    parser.add_argument("--no-overlap", action="store_true", help="sync only after backward")
    parser.add_argument("--reconfigure-timeout", type=float, default=300.0)
    parser.add_argument(
        "--device",
        default="auto",
        choices=["cpu", "cuda", "auto"],
        help="auto: this rank's GPU (NCCL) when every rank of the host has one, else CPU (gloo)",
    )
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: autocast compute; weights, AdamW state and reductions fp32")
    parser.add_argument("--micro-batch-size", type=int, metavar="N",
                        help="sequences per forward pass: a replica's share of the batch runs "
                        "as micro-batches whose gradients accumulate (default: all at once)")
    parser.add_argument("--activation-checkpointing", default="none", choices=CHECKPOINTING,
                        help="layers that keep only their input and recompute in backward: "
                        "every one (full), one in --activation-checkpointing-every (selective)")
    parser.add_argument("--activation-checkpointing-every", type=int, metavar="N",
                        default=schema_default("activationCheckpointing.every"))
    parser.add_argument("--sharded-state", action="store_true",
                        help="keep each unit's AdamW moments and master weights on one "
                        "replica's rank (ZeRO-1 across the replicas), which sends the updated "
                        "unit to the others")
    parser.add_argument("--measure-memory", action="store_true",
                        help="record each step's and each relayout's peak tensor memory in the "
                        "--out record (on the CPU it slows every operator down)")
    parser.add_argument("--data", type=Path, help="a prepared dataset (python -m ntp.prepare); "
                        "default: synthetic sequences")
    parser.add_argument("--tokenizer", type=Path,
                        help="refuse a dataset not tokenized with this tokenizer.json")
    parser.add_argument("--init", type=Path,
                        help="checkpoint (or checkpoint directory) to start from")
    parser.add_argument("--save", type=Path,
                        help="the job's checkpoint directory, written at the end")
    parser.add_argument("--save-every", type=int, default=0, help="also every N steps (0: never)")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest)")
    parser.add_argument("--blocking-save", action="store_true",
                        help="write each checkpoint before training on (default: in the "
                        "background once copied to CPU memory)")
    parser.add_argument(
        "--resume", action="store_true",
        help="start from the newest checkpoint under --save when there is one",
    )
    parser.add_argument("--out", type=Path, help="directory for per-rank metrics and grad dumps")
    parser.add_argument(
        "--dump",
        action="store_true",
        help="with --out: each rank's local gradients after the first step (grads-rank{G}.pt) "
        "and its local weights and AdamW moments at the end (state-rank{G}.pt)",
    )
    # The trainer's own options first, so that --help needs no invocation; what is left is
    # the invocation's, or unknown.
    opts, rest = parser.parse_known_args(argv)
    try:
        invocation = RankInvocation.from_args(rest)
    except InvocationError as exc:
        parser.error(str(exc))
    if invocation.options:
        parser.error(f"unrecognized arguments: {' '.join(invocation.options)}")
    if opts.dump and opts.out is None:
        parser.error("--dump needs --out")
    if opts.micro_batch_size is not None and opts.micro_batch_size < 1:
        parser.error(f"--micro-batch-size must be at least 1, got {opts.micro_batch_size}")
    if opts.activation_checkpointing_every < 1:
        parser.error("--activation-checkpointing-every must be at least 1")
    try:
        schedule(opts)
    except ValueError as exc:
        parser.error(str(exc))
    if opts.eval_every < 0 or opts.eval_samples < 1:
        parser.error("--eval-every must be at least 0 and --eval-samples at least 1")
    return invocation, opts


def schedule(opts: argparse.Namespace) -> Schedule:
    return Schedule(opts.lr_schedule, opts.warmup_steps, opts.decay_steps, opts.min_lr_ratio)


def config_from(opts: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        device=pick_device(opts.device),
        precision=opts.precision,
        flavor=opts.flavor,
        lr=opts.lr,
        weight_decay=opts.weight_decay,
        weight_decay_all=opts.weight_decay_all,
        schedule=schedule(opts),
        seed=opts.seed,
        bucket_elements=opts.bucket_elements,
        overlap=not opts.no_overlap,
        max_grad_norm=opts.max_grad_norm,
        micro_batch=opts.micro_batch_size,
        activation_checkpointing=opts.activation_checkpointing,
        checkpoint_every=opts.activation_checkpointing_every,
        sharded_state=opts.sharded_state,
        measure_memory=opts.measure_memory,
        eval_every=opts.eval_every,
        eval_samples=opts.eval_samples,
    )


def checkpointing_from(opts: argparse.Namespace) -> Checkpointing:
    return Checkpointing(
        opts.save, opts.save_every, opts.init, keep=opts.keep, blocking=opts.blocking_save
    )


def open_data(
    opts: argparse.Namespace, layout: JobLayout, carried: ModelArgs | None
) -> TokenDataset | None:
    if opts.data is None:
        return None
    args = model_args(opts.flavor, layout, carried)
    return TokenDataset.open(
        opts.data, args.max_seq_len, opts.seed, args.vocab_size, tokenizer=opts.tokenizer,
        held_out=opts.eval_samples if opts.eval_every else 0,
    )
