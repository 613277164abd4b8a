"""Every metrics page the project serves passes `promtool check metrics` (names, types, help,
units, as Prometheus' own linter judges them): each page in `PAGES` is started, fetched once it
shows all its families, and handed to promtool, which must report nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from kubernetes import client

from ntp.nodeagent.metrics import serve
from ntp.nodeagent.progress import NodeProgress
from tessera_contracts.api import GROUP, POWER_TARGET_PLURAL, VERSION
from tessera_contracts.powertarget import PowerTarget, to_object
from tessera_contracts.rank_events import EventKind, RankEvent, StepRecord
from tessera_dev import probes, processes
from tessera_dev.controlplane import launcher
from tessera_kube import lifetime

pytestmark = pytest.mark.ship

# A page is started by a function of the test's tmp_path and its fixtures (a page that needs the
# control plane asks for it) that yields the page's URL once it shows every family it serves.
Page = Callable[[Path, pytest.FixtureRequest], AbstractContextManager[str]]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@contextmanager
def trainer_node_agent(_tmp: Path, _request: pytest.FixtureRequest) -> Iterator[str]:
    """The node agent's page as `ntp.nodeagent.main` serves it, fed its two ranks' lines: steps,
    a checkpoint, a failure, the restore to the checkpoint and a step at TP 7,8, so that every
    family has samples."""
    progress = NodeProgress("gpu-node-0", steps=10)

    def step(n: int, generation: int, degrees: tuple[int, int]) -> None:
        for rank in (0, 1):
            progress.record(StepRecord(step=n, rank=rank, generation=generation, loss=2.5,
                                       step_s=0.2, samples=8, tokens=8 * 128,
                                       tp_degrees=degrees))

    def event(kind: EventKind, at_step: int, generation: int, degrees: tuple[int, int]) -> None:
        progress.record(RankEvent(kind, rank=0, generation=generation, step=at_step,
                                  tp_degrees=degrees, time=0.0))

    for n in (1, 2):
        step(n, 1, (8, 8))
    event(EventKind.SAVING_CHECKPOINT, 2, 1, (8, 8))
    event(EventKind.CHECKPOINTED, 2, 1, (8, 8))
    step(3, 1, (8, 8))
    progress.interrupted("a GPU failed")
    event(EventKind.RESTORING, 3, 2, (7, 8))
    event(EventKind.RESTORED, 2, 2, (7, 8))
    step(3, 2, (7, 8))
    server = serve(progress.ledger, "127.0.0.1", 0, {"ntpjob": "llama", "node": "gpu-node-0"},
                   lambda: progress.loss, progress.step_times)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def power_agent(tmp: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """`tessera power-agent` as a process on simulated GPUs, following a GPUPowerTarget on the
    control plane that boosts one GPU."""
    request.getfixturevalue("tessera_crds")
    plane: launcher.ControlPlane = request.getfixturevalue("control_plane")
    node = f"promtool-{os.getpid()}"
    target = PowerTarget(node=node, rack="rack-0", budget_w=2400, base_w=500,
                         rack_budget_w=4800, gpu_w={1: 700})
    with plane.api_client() as api:
        objects = client.CustomObjectsApi(api)
        objects.create_cluster_custom_object(GROUP, VERSION, POWER_TARGET_PLURAL,
                                             to_object(target))
        (port,) = processes.free_ports(1)
        log = tmp / "power-agent.log"
        with log.open("wb") as out:
            agent = subprocess.Popen(
                [sys.executable, "-m", "tessera_cli.main", "power-agent", "--node", node,
                 "--backend", "sim", "--sim-gpus", "4", "--sim-state", str(tmp / "gpus.json"),
                 "--state-dir", str(tmp / "state"), "--kubeconfig", str(plane.kubeconfig),
                 "--interval", "0.2", "--metrics-addr", "127.0.0.1",
                 "--metrics-port", str(port)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=lifetime.die_with_parent())
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            probes.poll_until(
                lambda: _page_or_empty(url), lambda page: "tessera_rack_power_budget_watts{" in page
                and 'tessera_gpu_power_boosted{gpu="1"' in page, timeout=60, interval=0.2,
                error=lambda _: AssertionError(log.read_text()[-3000:]))
            yield url
        finally:
            agent.terminate()
            agent.wait(timeout=30)
            objects.delete_cluster_custom_object(GROUP, VERSION, POWER_TARGET_PLURAL, node)


def _page_or_empty(url: str) -> str:
    try:
        return fetch(url)
    except OSError:  # not serving yet
        return ""


# The health agent's and the operator's pages join here, one entry each.
PAGES: dict[str, Page] = {
    "trainer node agent": trainer_node_agent,
    "power agent": power_agent,
}


@pytest.mark.parametrize("name", PAGES)
def test_promtool_check_metrics_passes_on_the_page(
        name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not on PATH: `make setup` installs Debian's prometheus",
                    pytrace=False)
    with PAGES[name](tmp_path, request) as url:
        page = fetch(url)
    assert page.count("# TYPE ") >= 5, page  # a page, not an empty registry
    done = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True,
                          text=True, timeout=60)
    problems = (done.stdout + done.stderr).strip()
    assert done.returncode == 0 and not problems, f"{name}: {problems}\n\n{page}"
