"""The `tessera` command: one entry point whose subcommands live in the module that owns them."""

from __future__ import annotations

import importlib
import sys

# name -> ("module" or "module:function", whose `main(argv) -> int` or function runs the command;
# one-line help). Modules load lazily so that
# `tessera --help` stays fast and a GPU-less machine never imports torch for a cluster command.
COMMANDS: dict[str, tuple[str, str]] = {
    "build-controlplane": (
        "tessera_operator.controlplane.build",
        "build the Kubernetes control plane from the Go module registry (cached by version)",
    ),
    "up": ("tessera_operator.controlplane.up",
           "start the local cluster: control plane, simulated GPU nodes, Prometheus"),
    "down": ("tessera_operator.controlplane.down", "stop the local cluster, leaving no process"),
    "sim-node": ("tessera_operator.simnode.node", "run one simulated GPU node (started by `up`)"),
    "fail-gpu": ("tessera_operator.simnode.faults:fail_gpu",
                 "make a simulated GPU fail as hardware does (XID, its process dies)"),
    "restore-gpu": ("tessera_operator.simnode.faults:restore_gpu", "bring a failed GPU back"),
    "fail-node": ("tessera_operator.simnode.faults:fail_node",
                  "stop a simulated node: heartbeat and pods"),
    "demo": ("tessera_operator.demo", "run the local demo end to end"),
    "operator": ("tessera_operator.run", "run the Tessera operator (reconcile NTPTrainingJobs)"),
    "cordon-gpu": ("tessera_operator.cordon", "cordon one GPU of a node: Tessera plans around it"),
    "uncordon-gpu": ("tessera_operator.uncordon", "give a cordoned GPU back to the planner"),
    "power-agent": ("power_controller.agent", "run the node power agent (DaemonSet entry point)"),
    "health-agent": ("power_controller.health_agent", "publish this node's GPU health from DCGM"),
    "simulate": ("tessera_operator.simulator.cli", "simulate a large job under GPU failures"),
    "bench": ("", "benchmarks: `tessera bench ntp|sim|operator`"),
}

BENCHES: dict[str, str] = {
    "ntp": "ntp.bench",
    "sim": "tessera_operator.simulator.bench",
    "operator": "tessera_operator.opbench",
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: tessera COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`tessera COMMAND --help` describes each command."]
    return "\n".join(lines)


def _run(target: str, argv: list[str]) -> int:
    module, _, function = target.partition(":")
    return int(getattr(importlib.import_module(module), function or "main")(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name == "bench":
        usage = (f"usage: tessera bench {{{','.join(BENCHES)}}} [ARGS...]\n"
                 "`tessera bench NAME --help` describes each benchmark.")
        if rest and rest[0] in ("-h", "--help"):
            print(usage)
            return 0
        if not rest or rest[0] not in BENCHES:
            unknown = f"tessera bench: unknown benchmark {rest[0]!r}\n" if rest else ""
            print(unknown + usage, file=sys.stderr)
            return 2
        return _run(BENCHES[rest[0]], rest[1:])
    if name not in COMMANDS:
        print(f"tessera: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return _run(COMMANDS[name][0], rest)


if __name__ == "__main__":
    sys.exit(main())
