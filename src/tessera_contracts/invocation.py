"""The command lines between processes: the node agent's, which the operator gives each trainer
pod (`AgentInvocation`), and each rank's, which the node agent starts (`ntp.train`,
`RankInvocation`). The writer builds the value and renders it with `to_args`; the reader parses
its argv once with `from_args` and passes the value on. A command line that does not follow
the contract is an `InvocationError` naming the option.

Steps have one name per meaning: `--until-step K` is the job's steps in all (train until the
job has done K steps, whatever step the process starts at), what the operator gives the agent
from the job's `spec.steps` and the agent gives every rank; `--steps N` is a count, N more
steps from where the process starts, for a rank run by hand.

What follows `--` on the agent's command line is the trainer's own options (the job's checkpoint
options and `spec.args`): the agent passes them to every rank unchanged, and only `ntp.train`
reads them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

# The agent serves its node's goodput metrics on this port unless told otherwise.
METRICS_PORT = 9300
# What a rank runs when given neither --steps nor --until-step.
DEFAULT_RANK_STEPS = 10
# A rank's exit status when its generation failed and no later one was published within its
# reconfiguration timeout: the job cannot go on live, and its node agent fails the pod (so the
# operator restarts the job from its checkpoint) rather than wait for a generation nobody plans.
STRANDED_EXIT = 3
# The trainer options the agent sets for each rank itself: refused after the agent's `--`.
RANK_OPTIONS = ("--layout", "--layout-dir", "--steps", "--until-step", "--join")


class InvocationError(ValueError):
    """A command line that does not follow the contract; the message names the option."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises InvocationError where it would print the usage and exit."""

    def error(self, message: str) -> NoReturn:
        raise InvocationError(message)


def _at_least(option: str, value: int | None, least: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < least):
        raise InvocationError(f"{option} must be at least {least}, got {value!r}")


# ----------------------------------------------------------------------------------------------
# The node agent: `python -m ntp.nodeagent`
# ----------------------------------------------------------------------------------------------


def agent_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser
                 ) -> argparse.ArgumentParser:
    """The node agent's command line as argparse reads it (its `--help` and usage)."""
    parser = parser_class(
        prog="ntp.nodeagent",
        description="Run this node's trainer ranks across the job's generations.",
        epilog="Trainer options (ntp.train) go after `--`; the agent sets "
        + ", ".join(RANK_OPTIONS) + " for each rank itself.",
        allow_abbrev=False,
    )
    parser.add_argument("--node", help="this node's name, as generations name GPUs (default: "
                        "env NODE_NAME)")
    parser.add_argument("--until-step", type=int, required=True, metavar="K",
                        help="the job's steps in all: every rank trains until the job has done "
                        "this many")
    parser.add_argument("--work-dir", type=Path,
                        help="where the ranks' gen{N}.json are mirrored (default: a new temp dir)")
    parser.add_argument("--job", help="the NTPTrainingJob: the agent follows its layout "
                        "ConfigMap and writes its progress ConfigMap")
    parser.add_argument("--generations", type=Path,
                        help="follow a directory of gen{N}.json instead (no Kubernetes); the "
                        "progress report goes to DIR/../progress/<node>.json, and the job is "
                        "--job or else named after DIR's parent")
    parser.add_argument("--namespace", help="the job's namespace (default: the pod's own)")
    parser.add_argument("--metrics-port", type=int, default=METRICS_PORT,
                        help="serve the node's goodput metrics here, on $POD_IP if set "
                        "(0: no metrics)")
    return parser


@dataclass(frozen=True)
class AgentInvocation:
    """The trainer pod's node agent, as the operator runs it: the job it follows (`job`, or a
    directory of generation documents), the job's steps in all, and the trainer options for
    every rank. `node` None: the agent takes its node's name from its environment."""

    until_step: int
    job: str | None = None
    generations: Path | None = None
    node: str | None = None
    namespace: str | None = None
    work_dir: Path | None = None
    metrics_port: int = METRICS_PORT
    trainer_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _at_least("--until-step", self.until_step, 1)
        if self.job is None and self.generations is None:
            raise InvocationError("one of --job or --generations is required")
        _at_least("--metrics-port", self.metrics_port, 0)
        if self.metrics_port > 65535:
            raise InvocationError(f"--metrics-port must be a port or 0, got {self.metrics_port}")

    def to_args(self) -> list[str]:
        args: list[str] = []
        for option, value in (("--node", self.node), ("--job", self.job),
                              ("--generations", self.generations),
                              ("--namespace", self.namespace)):
            if value is not None:
                args += [option, str(value)]
        args += ["--until-step", str(self.until_step)]
        if self.work_dir is not None:
            args += ["--work-dir", str(self.work_dir)]
        if self.metrics_port != METRICS_PORT:
            args += ["--metrics-port", str(self.metrics_port)]
        return args + (["--", *self.trainer_args] if self.trainer_args else [])

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> AgentInvocation:
        """The agent's options, and after `--` the trainer options, which must leave the
        agent's own per-rank options (RANK_OPTIONS) to it."""
        argv = list(argv)
        own, trainer = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) \
            if "--" in argv else (argv, [])
        opts = agent_parser(_Parser).parse_args(own)
        taken = [a for a in trainer if a.split("=")[0] in RANK_OPTIONS]
        if taken:
            raise InvocationError(f"the agent sets {', '.join(taken)} for each rank itself")
        return cls(until_step=opts.until_step, job=opts.job, generations=opts.generations,
                   node=opts.node, namespace=opts.namespace, work_dir=opts.work_dir,
                   metrics_port=opts.metrics_port, trainer_args=tuple(trainer))


# ----------------------------------------------------------------------------------------------
# A rank: `python -m ntp.train`
# ----------------------------------------------------------------------------------------------


def _rank_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ntp.train", add_help=False, allow_abbrev=False,
                     usage=argparse.SUPPRESS)
    group = parser.add_argument_group("the rank's invocation (its node agent sets these)")
    group.add_argument("--layout", type=Path, metavar="FILE", help="generation document (kind "
                       "NTPGeneration) or explicit JobLayout document (required)")
    group.add_argument("--layout-dir", type=Path, metavar="DIR",
                       help="where gen{N}.json of later generations appear (default: FILE's)")
    length = group.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, metavar="N", help="train this many steps from "
                        f"where this process starts ({DEFAULT_RANK_STEPS})")
    length.add_argument("--until-step", type=int, metavar="K",
                        help="train until the job has done this many steps in all, whatever "
                        "step this process starts at (a joining rank learns it from the "
                        "survivors)")
    group.add_argument("--join", action="store_true",
                       help="join FILE's generation holding nothing (a GPU back in the job)")
    return parser


def rank_help() -> str:
    """The invocation's options as `ntp.train --help` shows them."""
    return _rank_parser().format_help()


@dataclass(frozen=True)
class RankInvocation:
    """One rank, as the node agent starts it: the generation it starts in (`layout`), where
    later ones appear, how long it trains, whether it joins holding nothing; then the
    trainer's own options, passed through (`options`)."""

    layout: Path
    layout_dir: Path | None = None
    until_step: int | None = None
    steps: int | None = None
    join: bool = False
    options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.steps is not None and self.until_step is not None:
            raise InvocationError("--until-step: not allowed with --steps")
        _at_least("--steps", self.steps, 0)
        _at_least("--until-step", self.until_step, 0)

    def until(self, start: int) -> int:
        """The job's step this rank trains to, when it starts at step `start`."""
        if self.until_step is not None:
            return self.until_step
        return start + (DEFAULT_RANK_STEPS if self.steps is None else self.steps)

    def to_args(self) -> list[str]:
        args = ["--layout", str(self.layout)]
        if self.layout_dir is not None:
            args += ["--layout-dir", str(self.layout_dir)]
        if self.until_step is not None:
            args += ["--until-step", str(self.until_step)]
        if self.steps is not None:
            args += ["--steps", str(self.steps)]
        return args + (["--join"] if self.join else []) + list(self.options)

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> RankInvocation:
        """The invocation's options from `argv`; every other argument, in order, is the
        trainer's own (`options`)."""
        opts, rest = _rank_parser().parse_known_args(list(argv))
        if opts.layout is None:
            raise InvocationError("--layout is required")
        return cls(layout=opts.layout, layout_dir=opts.layout_dir, until_step=opts.until_step,
                   steps=opts.steps, join=opts.join, options=tuple(rest))
