"""The `tessera-dev` command: the local GPU cluster, fault injection, the demo, the simulator and
the benches. The production verbs are the `tessera` command's (tessera_cli)."""

from __future__ import annotations

import sys

from tessera_cli.main import Commands, dispatch, run

COMMANDS: Commands = {
    "build-controlplane": (
        "tessera_dev.controlplane.build",
        "build the Kubernetes control plane and helm from the Go module registry (cached by "
        "version)",
    ),
    "up": ("tessera_dev.controlplane.up",
           "start the local cluster: control plane, simulated GPU nodes, Prometheus"),
    "down": ("tessera_dev.controlplane.down", "stop the local cluster, leaving no process"),
    "sim-node": ("tessera_dev.simnode.node", "run one simulated GPU node (started by `up`)"),
    "fail-gpu": ("tessera_dev.simnode.faults:fail_gpu",
                 "make a simulated GPU fail as hardware does (XID, its process dies)"),
    "restore-gpu": ("tessera_dev.simnode.faults:restore_gpu", "bring a failed GPU back"),
    "fail-node": ("tessera_dev.simnode.faults:fail_node",
                  "stop a simulated node: heartbeat and pods"),
    "demo": ("tessera_dev.demo", "run the local demo end to end"),
    "simulate": ("tessera_sim.cli", "simulate a large job under GPU failures"),
    "bench": ("", "benchmarks: `tessera-dev bench ntp|sim|operator|training|recovery`"),
    "lock": ("tessera_dev.lock",
             "pin each image's whole environment (constraints/) from pyproject.toml's pins"),
    "image-sizes": ("tessera_dev.imagesize",
                    "install each image's environment afresh and report its size"),
    "crd-reference": ("tessera_dev.crdref",
                      "write docs/crd-reference.md from the CRDs' schemas"),
}

BENCHES: dict[str, str] = {
    "ntp": "ntp.bench",
    "sim": "tessera_sim.bench",
    "operator": "tessera_dev.opbench",
    "training": "tessera_dev.trainbench",
    "recovery": "tessera_dev.recoverybench",
}


def _bench(rest: list[str]) -> int:
    usage = (f"usage: tessera-dev bench {{{','.join(BENCHES)}}} [ARGS...]\n"
             "`tessera-dev bench NAME --help` describes each benchmark.")
    if rest and rest[0] in ("-h", "--help"):
        print(usage)
        return 0
    if not rest or rest[0] not in BENCHES:
        unknown = f"tessera-dev bench: unknown benchmark {rest[0]!r}\n" if rest else ""
        print(unknown + usage, file=sys.stderr)
        return 2
    return run(BENCHES[rest[0]], rest[1:])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "bench":
        return _bench(args[1:])
    return dispatch("tessera-dev", COMMANDS, args)


if __name__ == "__main__":
    sys.exit(main())
