"""The `tessera` command: one entry point whose subcommands live in the module that owns them.

Modules load lazily, so `tessera --help` stays fast and each command imports only its own
process's dependencies (the operator extra has no torch; the agent extra no kopf).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping

# name -> ("module" or "module:function", whose `main(argv) -> int` or function runs the command;
# one-line help)
Commands = Mapping[str, tuple[str, str]]

COMMANDS: Commands = {
    "operator": ("tessera_operator.run", "run the Tessera operator (reconcile NTPTrainingJobs)"),
    "power-agent": ("tessera_agents.power.main:serve",
                    "run the node power agent (DaemonSet entry point)"),
    "health-agent": ("tessera_agents.health.main:serve",
                     "publish this node's GPU health from DCGM"),
    "cordon-gpu": ("tessera_cli.cordon", "cordon one GPU of a node: Tessera plans around it"),
    "uncordon-gpu": ("tessera_cli.uncordon", "give a cordoned GPU back to the planner"),
    "plan": ("tessera_cli.plan",
             "a job's memory per GPU, healthy and degraded, from its YAML (no cluster)"),
    "uninstall": ("tessera_cli.uninstall",
                  "refuse while NTPTrainingJobs exist (--delete-jobs: delete them, wait for "
                  "their GPUs to settle), stop the operator (before removing Tessera)"),
    # The trainer's tools (the trainer extra: torch, tokenizers, safetensors).
    "prepare-data": ("ntp.prepare", "tokenize text, JSONL or Parquet files into a dataset"),
    "import-hf": ("ntp.hf_cli:import_main",
                  "write a Hugging Face directory as a job's first checkpoint"),
    "export-hf": ("ntp.hf_cli:export_main",
                  "write a checkpoint as a Hugging Face directory (bf16 or fp32)"),
}


def version() -> str:
    from importlib import metadata  # only here: 40 ms of imports that --help does not need

    return metadata.version("tessera")


def usage(prog: str, commands: Commands) -> str:
    width = max(map(len, commands))
    lines = [f"usage: {prog} COMMAND [ARGS...]", f"       {prog} --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in commands.items()]
    lines += ["", f"`{prog} COMMAND --help` describes each command."]
    return "\n".join(lines)


def run(target: str, argv: list[str]) -> int:
    module, _, function = target.partition(":")
    return int(getattr(importlib.import_module(module), function or "main")(argv) or 0)


def dispatch(prog: str, commands: Commands, argv: list[str] | None) -> int:
    """Run `argv`'s command from `commands`; help, `--version` and unknown names answered here."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(prog, commands))
        return 0
    if args[0] == "--version":
        print(f"{prog} {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}\n\n{usage(prog, commands)}", file=sys.stderr)
        return 2
    return run(commands[name][0], rest)


def main(argv: list[str] | None = None) -> int:
    return dispatch("tessera", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
