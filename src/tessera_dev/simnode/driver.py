"""The simulated node's DRA driver, in the role of NVIDIA's kubelet plugin (k8s-dra-driver-gpu):
it publishes the node's GPUs as a ResourceSlice (dra.py says what it holds), keeps the slice's
device taints as the driver's faults say, resolves a pod's allocated devices when the pod starts
(the kubelet's PrepareResources), and tells the node when a device's health changes, for the
pods' `allocatedResourcesStatus`.

The taints come from NODE_DIR/dra-taints.json, which `tessera-dev fail-gpu --dra-taint` writes
(and `restore-gpu` clears): GPU index -> {key, value, effect}. Health is the GPU state's
(`gpus.json`). Both are read every POLL_S; a change republishes the slice, or wakes the pods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from tessera_agents.power.sim_backend import SimBackend
from tessera_dev.simnode import dra
from tessera_dev.simnode.kube import NodeApi
from tessera_dev.simnode.podspec import NotYetAvailable
from tessera_kube import files

log = logging.getLogger(__name__)

TAINTS_FILE = "dra-taints.json"
POLL_S = 0.5
PREPARE_REASON = "FailedPrepareDynamicResources"  # the kubelet's event reason


def read_taints(node_dir: Path) -> dict[int, dra.Taint]:
    """The device taints the node's driver holds, by GPU index."""
    data = files.read_json(node_dir / TAINTS_FILE) or {}
    return {int(index): dra.Taint.from_dict(taint) for index, taint in data.items()}


def set_taint(node_dir: Path, index: int, taint: dra.Taint | None) -> None:
    """Taint GPU `index` of the node's driver, or (None) clear its taint."""
    path = node_dir / TAINTS_FILE
    with files.locked(path):
        taints = read_taints(node_dir)
        if taint is None:
            taints.pop(index, None)
        else:
            taints[index] = taint
        files.write_json_atomic(path, {str(i): t.to_dict() for i, t in sorted(taints.items())})


class DraDriver:
    """The node's DRA driver: its slice, its taints, its devices' health."""

    def __init__(self, node: str, node_dir: Path, api: NodeApi, gpus: SimBackend,
                 health_changed: Callable[[], None]) -> None:
        self.node = node
        self.dir = node_dir
        self.api = api
        self.gpus = gpus
        self.health_changed = health_changed
        self._published: dict[int, dra.Taint] | None = None
        self._healthy: set[int] | None = None

    def healthy(self) -> set[int]:
        """The GPUs the driver reports healthy."""
        return {gpu.index for gpu in self.gpus.snapshot() if gpu.healthy}

    def publish(self) -> None:
        """Publish the slice with the taints of the file, if they differ from the last
        published."""
        taints = read_taints(self.dir)
        if taints == self._published:
            return
        generation = self.api.publish_slice(
            dra.resource_slice(self.node, self.gpus.snapshot(), taints, generation=1))
        self._published = taints
        log.info("ResourceSlice %s published (pool generation %d, tainted GPUs: %s)",
                 dra.slice_name(self.node), generation, sorted(taints) or "none")

    def run(self) -> None:
        """Keep the slice and the health current, for the process's life."""
        failed = ""
        while True:
            try:
                self.publish()
                failed = ""
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                # the API server may be restarting, or the file half-read: the next poll
                # retries; each new reason is logged once
                if str(exc) != failed:
                    log.warning("publishing the ResourceSlice failed", exc_info=True)
                failed = str(exc)
            healthy = self.healthy()
            if healthy != self._healthy:
                changed = self._healthy is not None
                self._healthy = healthy
                if changed:
                    self.health_changed()
            time.sleep(POLL_S)

    def prepare(self, pod: Mapping[str, Any]) -> dict[str, list[dra.Device]]:
        """The devices of this node the scheduler allocated to each of the pod's claims (by the
        name the pod gives the claim); NotYetAvailable while a claim is not known or allocated."""
        namespace = pod["metadata"]["namespace"]
        try:
            found = {}
            for name, claim_name in dra.pod_claims(pod).items():
                claim = self.api.read_claim(namespace, claim_name)
                if claim is None:
                    raise dra.ClaimNotReady(f"ResourceClaim {claim_name!r} not found")
                found[name] = dra.allocated(claim, self.node)
            return found
        except dra.ClaimNotReady as exc:
            raise NotYetAvailable(PREPARE_REASON, str(exc)) from exc
