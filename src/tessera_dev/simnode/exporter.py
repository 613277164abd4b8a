"""dcgm-exporter's stand-in on a simulated node: what a node runs for the image
`nvcr.io/nvidia/k8s/dcgm-exporter` (images.STAND_INS).

It serves the node's simulated GPUs (`dcgm.render` of the GPU state the node shares with the pods
that see GPUs, TESSERA_SIM_GPU_STATE) at /metrics, and /health, on DCGM_EXPORTER_LISTEN
(`[HOST]:PORT`, `:9400` as the GPU Operator sets it), labelled `hostname` = NODE_NAME as
dcgm-exporter labels its samples, in the field names of TESSERA_SIM_DCGM_GENERATION (the node's
`--dcgm-generation`). Every pod of a simulated node shares the host's network, so with no HOST
it listens on its pod's address (POD_IP) rather than on every address. Runs until killed.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from tessera_agents.power.sim_backend import SimBackend
from tessera_dev.simnode import dcgm
from tessera_dev.simnode.server import exporter_endpoint

GENERATION_ENV = "TESSERA_SIM_DCGM_GENERATION"
STATE_ENV = "TESSERA_SIM_GPU_STATE"


class SettingError(Exception):
    """An environment the exporter cannot run with: one line."""


def settings(env: Mapping[str, str]) -> tuple[str, int, Path, str, str]:
    """(address, port, GPU state file, hostname, generation) from the container's environment."""
    listen = env.get("DCGM_EXPORTER_LISTEN", ":9400")
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingError(f"DCGM_EXPORTER_LISTEN {listen!r} is not [HOST]:PORT")
    address = host.strip("[]") or env.get("POD_IP", "")
    if not address:
        raise SettingError("DCGM_EXPORTER_LISTEN names no host and POD_IP is not set")
    state = env.get(STATE_ENV)
    if not state:
        raise SettingError(f"{STATE_ENV} is not set: the pod sees no GPU "
                           "(runtimeClassName: nvidia)")
    hostname = env.get("NODE_NAME")
    if not hostname:
        raise SettingError("NODE_NAME is not set")
    generation = env.get(GENERATION_ENV, "4.9")
    if generation not in dcgm.GENERATIONS:
        raise SettingError(f"{GENERATION_ENV} {generation!r} is not one of "
                           f"{', '.join(dcgm.GENERATIONS)}")
    return address, int(port), Path(state), hostname, generation


def main(argv: list[str]) -> int:
    del argv  # configured by its environment, as dcgm-exporter's image is in the GPU Operator's
    try:
        address, port, state, hostname, generation = settings(os.environ)
        gpus = SimBackend(state_path=state)
        exporter_endpoint(address, port, lambda: dcgm.render(
            gpus.snapshot(), hostname=hostname, generation=generation))
    except (SettingError, OSError, ValueError, KeyError) as exc:
        print(f"dcgm-exporter (simulated): {exc}", file=sys.stderr)
        return 1
    print(f"dcgm-exporter (simulated) for {hostname} on {address}:{port}", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
