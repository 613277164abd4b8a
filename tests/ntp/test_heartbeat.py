"""The node agents' heartbeats (`ntp.nodeagent.heartbeat`) on real processes around a real
TCPStore: a frozen or killed agent is declared silent by its watchers within the bound (timeout
plus a beat, under 2 s), and no longer once it beats again; an agent that leaves a finished job
is never declared; the settings refuse values that would make one late beat a loss. A node's
progress report lists the nodes its agent finds silent, and the operator takes them as lost."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ntp.nodeagent.heartbeat import BEAT_S, TIMEOUT_S, Settings, beat_key, watched
from tessera_contracts.progress import NodeReport, ReportError
from tessera_dev import probes
from tessera_kube.lifetime import die_with_parent
from tessera_operator import health

pytestmark = pytest.mark.recovery

NODES = ("node-a", "node-b", "node-c")
BOUND_S = 2.0  # issue 20: survivors learn of a loss in under 2 s
# A hang guard on 2 shared cores (each process imports torch); every wait ends on its event.
HANG_S = 60.0

# One agent's heartbeat as the node agent runs it (`NodeAgent.watch_peers`): tick from the main
# loop; print each node it finds silent and each change of the silent set; on "done" from stdin
# say so on the store and leave.
AGENT = """
import json, select, sys, time
import torch.distributed as dist
from ntp.nodeagent.heartbeat import Heartbeat
port, node, nodes = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
heartbeat = Heartbeat(dist.TCPStore("127.0.0.1", port, is_master=False), node)
silent = set()
while True:
    for lost in heartbeat.tick(nodes):
        print(json.dumps({"lost": lost, "at": time.time()}), flush=True)
    if set(heartbeat.silent) != silent:
        silent = set(heartbeat.silent)
        print(json.dumps({"silent": sorted(silent)}), flush=True)
    if select.select([sys.stdin], [], [], 0.01)[0] and sys.stdin.readline().strip() == "done":
        heartbeat.done()
        break
"""


class Agent:
    """One heartbeat process; its lines in a queue as they come."""

    def __init__(self, port: int, node: str) -> None:
        self.node = node
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AGENT, str(port), node, ",".join(NODES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=die_with_parent())
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self, what: str) -> dict:
        """The next line that says `what` (lost, silent)."""
        deadline = time.monotonic() + HANG_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if what in line:
                return line
        raise AssertionError(f"{self.node} printed no {what!r} line in {HANG_S:.0f} s")

    def said(self) -> list[dict]:
        out = []
        while not self.lines.empty():
            out.append(self.lines.get_nowait())
        return out


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def agents(store: dist.TCPStore) -> Iterator[dict[str, Agent]]:
    """An agent per node, each past its fourth beat when yielded: every watcher has seen the
    others beat (a node is judged only once its watcher saw it beat)."""
    running = {node: Agent(store.port, node) for node in NODES}
    probes.poll_until(lambda: [store.add(beat_key(n), 0) for n in NODES],
                      lambda counts: min(counts) >= 4, timeout=HANG_S, interval=0.05,
                      error=lambda counts: AssertionError(f"not all beating: {counts}"))
    yield running
    for agent in running.values():
        if agent.proc.poll() is None:
            agent.proc.kill()  # a stopped one too
        agent.proc.wait()


def test_the_defaults_detect_within_the_bound():
    assert TIMEOUT_S + BEAT_S < BOUND_S
    assert Settings.from_env({}) == Settings(BEAT_S, TIMEOUT_S)


@pytest.mark.parametrize("env, error", [
    ({"TESSERA_HEARTBEAT_S": "0"}, "TESSERA_HEARTBEAT_S must be a positive number"),
    ({"TESSERA_HEARTBEAT_S": "fast"}, "TESSERA_HEARTBEAT_S must be a positive number"),
    ({"TESSERA_HEARTBEAT_TIMEOUT_S": "inf"}, "TESSERA_HEARTBEAT_TIMEOUT_S must be a positive"),
    ({"TESSERA_HEARTBEAT_S": "1", "TESSERA_HEARTBEAT_TIMEOUT_S": "1.5"}, "at least twice"),
])
def test_settings_that_make_a_late_beat_a_loss_are_refused_in_one_line(env, error):
    with pytest.raises(ValueError, match=error) as caught:
        Settings.from_env(env)
    assert "\n" not in str(caught.value)


def test_each_node_has_two_watchers_in_a_ring():
    nodes = [f"n{i}" for i in range(5)]
    assert watched(nodes, "n3") == ["n4", "n0"]
    assert watched(["a", "b"], "a") == ["b"]
    assert watched(["a"], "a") == []
    assert watched(["a", "b"], "c") == []  # a node out of the generation watches nobody
    watchers = {n: [w for w in nodes if n in watched(nodes, w)] for n in nodes}
    assert all(len(w) == 2 for w in watchers.values())


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL])
def test_a_frozen_or_dead_agent_is_declared_silent_by_its_watchers_within_the_bound(
        agents, fault, capsys):
    # node-b's watchers in the ring of three are node-a and node-c.
    lost = agents["node-b"]
    at = time.time()
    lost.proc.send_signal(fault)
    for node in ("node-a", "node-c"):
        line = agents[node].next("lost")
        assert line["lost"] == "node-b"
        detected_s = line["at"] - at
        with capsys.disabled():
            print(f"\n{node} found node-b silent {detected_s:.2f} s after {fault.name}")
        assert detected_s < BOUND_S
    if fault is signal.SIGSTOP:
        # Thawed, it beats again: its watchers no longer count it silent.
        lost.proc.send_signal(signal.SIGCONT)
        for node in ("node-a", "node-c"):
            assert agents[node].next("silent")["silent"] == ["node-b"]
            assert agents[node].next("silent")["silent"] == []
    # nobody else was blamed, not even by the thawed agent, which cannot tell who stalled
    assert not [line for agent in agents.values() for line in agent.said() if "lost" in line]


def test_an_agent_that_leaves_a_finished_job_is_not_declared_silent(store, agents):
    leaving = agents["node-b"]
    assert leaving.proc.stdin is not None
    leaving.proc.stdin.write("done\n")
    leaving.proc.stdin.flush()
    assert leaving.proc.wait(timeout=HANG_S) == 0
    # Its watchers beat on (and judge) for three timeouts: past any bound, nobody is blamed.
    beats = int(3 * TIMEOUT_S / BEAT_S)
    start = {n: store.add(beat_key(n), 0) for n in ("node-a", "node-c")}
    probes.poll_until(lambda: [store.add(beat_key(n), 0) - start[n] for n in start],
                      lambda moved: min(moved) >= beats, timeout=HANG_S, interval=0.1,
                      error=lambda moved: AssertionError(f"watchers stalled: {moved}"))
    for node in ("node-a", "node-c"):
        assert not [line for line in agents[node].said() if "lost" in line]


# -- what the operator makes of it ----------------------------------------------------------------

def _report(**fields: object) -> dict:
    return {"node": "node-a", "generation": 2, "step": 5, "steps": 10, "state": "Training"} \
        | fields


def test_a_report_lists_the_silent_nodes_and_an_older_agents_report_lists_none():
    report = NodeReport.from_dict(_report(silentNodes=["node-c", "node-b"]))
    assert report.silent_nodes == ("node-b", "node-c")
    assert NodeReport.from_json(report.to_json()) == report
    assert NodeReport.from_dict(_report()).silent_nodes == ()
    assert "silentNodes" not in NodeReport.from_dict(_report()).to_dict()


@pytest.mark.parametrize("value", ["node-b", [""], [3], None])
def test_silent_nodes_that_are_not_node_names_are_refused(value):
    with pytest.raises(ReportError, match="silentNodes: a list of node names"):
        NodeReport.from_dict(_report(silentNodes=value))


def test_the_operator_takes_a_node_its_agents_report_silent_as_lost_and_no_other():
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
    nodes = [{"metadata": {"name": n}, "status": {"conditions": [ready]}}
             for n in ("node-a", "node-b")]
    got = health.from_lost_nodes(nodes, 2, placed=["node-a", "node-b"],
                                 silent=["node-b", "elsewhere"])
    assert got.failed == {("node-b", 0), ("node-b", 1)}
    assert got.problems == ("node node-b: the job's node agents lost its heartbeat: its GPUs "
                            "are lost",)
