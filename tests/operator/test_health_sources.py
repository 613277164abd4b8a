"""DCGM as a health source: the nodes' GPUHealth objects, as their agents publish them, judged by
a job's fatal XIDs; unknown and stale GPUs are neither failed nor healthy; hostile objects are
ignored with the reason; merged with the cordons."""

from __future__ import annotations

from typing import Any

import pytest

from tessera_agents.health.agent import as_facts
from tessera_agents.health.dcgm import FlapDamper, classify
from tessera_agents.power.sim_backend import SimBackend
from tessera_contracts import api
from tessera_contracts.gpuhealth import PublishedHealth, read, render
from tessera_contracts.progress import NodeReport, State
from tessera_contracts.unreadable import Unreadable
from tessera_dev.simnode import dcgm
from tessera_operator import health

pytestmark = pytest.mark.operator

GPUS = 8
NOW = 1_700_000_000.0
CRD_DEFAULT = [48, 64, 74, 79, 94, 95, 119, 120, 140, 143, 144, 145, 149]


def published(node: str, fail: dict[int, int] = {}, *, at: float = NOW,  # noqa: B006
              page: str | None = None) -> dict[str, Any]:
    """The node's GPUHealth as its agent writes it, from its exporter's page."""
    gpus = SimBackend(count=GPUS, node=node, clock=lambda: at)
    for index, xid in fail.items():
        gpus.fail(index, xid=xid)
    text = page if page is not None else dcgm.render(gpus.snapshot(), hostname=node,
                                                     generation="4.9")
    observed = as_facts(classify(text, gpus=GPUS, fatal_xids=(), hostname=node, now=at))
    return render(PublishedHealth(node, "http://10.0.0.1:9400/metrics", at,
                                  FlapDamper(hold_xids=True).update(0, observed)))


def _read(objects: list[Any]) -> list[PublishedHealth | Unreadable]:
    """The objects as the operator's GPUHealth index holds them."""
    return [read(obj) for obj in objects]


def test_an_xid_fails_the_gpu_only_when_it_is_in_the_jobs_fatal_list() -> None:
    objects = [published("a", {3: 48}), published("b", {5: 13}), published("c")]
    by_crd = health.from_gpu_health(_read(objects), GPUS, CRD_DEFAULT, now=NOW)
    assert by_crd.failed == {("a", 3)}
    assert by_crd.unknown == frozenset() and by_crd.problems == ()
    strict = health.from_gpu_health(_read(objects), GPUS, [13], now=NOW)
    assert strict.failed == {("b", 5)}
    # no list: the NVIDIA device plugin's rule, every XID but the application errors
    assert health.from_gpu_health(_read(objects), GPUS, None, now=NOW).failed == {("a", 3)}


def test_a_health_watch_failing_on_something_else_than_an_xid_fails_the_gpu_for_any_job() -> None:
    page = dcgm.render(SimBackend(count=GPUS, node="a").snapshot(), hostname="a",
                       generation="4.8").splitlines()
    (mem,) = [i for i, line in enumerate(page)
              if 'gpu="2",' in line and 'health_watch="MEM"' in line]
    page[mem] = page[mem].replace('"DCGM_FR_OK"} 0', '"DCGM_FR_VOLATILE_DBE_DETECTED"} 20')
    obj = published("a", page="\n".join(page))
    assert health.from_gpu_health(_read([obj]), GPUS, [], now=NOW).failed == {("a", 2)}


def test_unknown_stale_and_missing_gpus_are_neither_failed_nor_healthy() -> None:
    partial = published("a", {1: 79})
    partial["status"]["gpus"][4].update(state="Unknown", reason="no health series for this GPU")
    del partial["status"]["gpus"][7]
    stale = published("b", {0: 79}, at=NOW - health.GPU_HEALTH_STALE_AFTER_S - 1)
    ahead = published("c", at=NOW + 3600)
    other_job = published("z", {0: 79})
    got = health.from_gpu_health(_read([partial, stale, ahead, other_job]), GPUS, CRD_DEFAULT,
                                 now=NOW, nodes=["a", "b", "c", "d"])
    assert got.failed == {("a", 1)}  # a stale object's XID is not believed either
    every = {(n, i) for n in "bcd" for i in range(GPUS)}
    assert got.unknown == {("a", 4), ("a", 7)} | every
    assert got.problems == (
        "node a: GPU health unknown for GPUs 4: no health series for this GPU",
        "node a: GPU health unknown for GPUs 7: not listed",
        "node b: GPU health unknown for GPUs 0, 1, 2, 3, 4, 5, 6, 7: its GPUHealth was "
        "published 361 s ago, over 360 s (is its health agent running?)",
        "node c: GPU health unknown for GPUs 0, 1, 2, 3, 4, 5, 6, 7: its GPUHealth claims to be "
        "from 3600 s in the future",
        "node d: GPU health unknown for GPUs 0, 1, 2, 3, 4, 5, 6, 7: the node published no "
        "GPUHealth",
    )


def test_an_unreachable_exporter_makes_its_nodes_gpus_unknown() -> None:
    obj = published("a", page="")
    got = health.from_gpu_health(_read([obj]), GPUS, CRD_DEFAULT, now=NOW)
    assert got.failed == frozenset() and got.unknown == {("a", i) for i in range(GPUS)}
    assert "no usable GPU health series" in got.problems[0]


@pytest.mark.parametrize(("mangle", "problem"), [
    (lambda o: o.pop("status"), "its GPUHealth is malformed (status: missing)"),
    (lambda o: o["status"].update(observedAt="yesterday"),
     "its GPUHealth is malformed (status.observedAt: not an RFC 3339 time: yesterday)"),
    (lambda o: o["status"].update(observedAt=12), "malformed (status.observedAt: not an RFC"),
    (lambda o: o["status"].update(observedAt=10**5000), "malformed (status.observedAt: not an"),
    (lambda o: o["status"].update(gpus="all"), "GPUs 0, 1, 2, 3, 4, 5, 6, 7: not listed"),
    (lambda o: o["status"]["gpus"].append({"index": 3, "state": "Failed"}), "GPU 3 listed twice"),
    (lambda o: o["status"]["gpus"].append({"index": "3"}), "without a GPU index"),
    (lambda o: o["status"]["gpus"].append({"index": True}), "without a GPU index"),
    (lambda o: o["status"]["gpus"].append(["x"] * 10_000), "without a GPU index"),
    (lambda o: o["status"]["gpus"].append({"index": 10**5000}), "with GPU index <int>"),
    (lambda o: o["status"]["gpus"][2].update(state="Broken"), "GPUs 2: state Broken"),
    (lambda o: o["status"]["gpus"][2].update(xids=["79", None, True, 2**80]), None),
    (lambda o: o["status"]["gpus"].append({"index": 99, "state": "Failed"}), None),
])
def test_a_hostile_object_is_ignored_with_the_reason(mangle, problem: str | None) -> None:
    obj = published("a", {5: 79})
    mangle(obj)
    got = health.from_gpu_health(_read([obj, {"metadata": {}}, ["not", "an", "object"]]), GPUS,
                                 CRD_DEFAULT, now=NOW)
    assert ("a", 2) not in got.failed
    assert got.problems.count("a GPUHealth object without a name, ignored") == 2
    if problem is not None:
        assert any(problem in line for line in got.problems), got.problems
        assert all(len(line) < 400 for line in got.problems)
    else:
        assert got.failed == {("a", 5)}


def test_merged_with_the_cordons() -> None:
    node = {"metadata": {"name": "a", "annotations": {api.CORDON_ANNOTATION: "0"}}}
    dcgm_signal = health.from_gpu_health(_read([published("a", {3: 79})]), GPUS, CRD_DEFAULT,
                                         now=NOW, nodes=["a", "b"])
    merged = health.from_cordons([node], GPUS).merge(dcgm_signal)
    assert merged.failed == {("a", 0), ("a", 3)}
    assert merged.unknown == {("b", i) for i in range(GPUS)} and len(merged.problems) == 1


def test_unknown_health_keeps_each_gpu_where_the_generation_in_force_has_it() -> None:
    """A GPU that failed and left the layout does not come back when its node's health goes
    stale or its series vanish (off the bus); one in the layout is not dropped either; a node
    that never published says nothing; without a generation nothing is held."""
    layout = [("a", i) for i in range(GPUS) if i != 3] + [("b", i) for i in range(GPUS)]
    stale = published("a", {3: 79}, at=NOW - health.GPU_HEALTH_STALE_AFTER_S - 1)
    vanished = published("b")
    vanished["status"]["gpus"][2].update(state="Unknown", reason="no health series")
    got = health.from_gpu_health(_read([stale, vanished]), GPUS, CRD_DEFAULT, now=NOW,
                                 nodes=["a", "b", "c"])
    assert got.failed == frozenset()  # as reported: unknown, not failed
    held = health.hold_unknown(got, layout, reporting=["a", "b"])
    assert held.failed == {("a", 3)}  # out of the layout, and kept out
    assert held.problems[-1] == ("node a: GPUs 3 stay out of the layout while their health "
                                 "is unknown")
    assert held.unknown == got.unknown
    # GPU 2 of b is in the layout: it stays. Node c never published: its GPUs are unknown
    # but not held (its cordons alone decide), though none is in the layout.
    assert ("b", 2) in got.unknown and {("c", i) for i in range(GPUS)} <= got.unknown
    assert health.hold_unknown(got, None, reporting=["a", "b"]) == got
    # Told again (healthy), the GPU is usable again.
    back = health.from_gpu_health(_read([published("a")]), GPUS, CRD_DEFAULT, now=NOW, nodes=["a"])
    assert health.hold_unknown(back, layout, reporting=["a"]).failed == frozenset()


def _node(name: str, *conditions: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"conditions": list(conditions)}}


def test_a_node_whose_kubelet_went_silent_loses_its_gpus_and_no_other() -> None:
    silent = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}
    nodes = [
        _node("gone", {"type": "MemoryPressure", "status": "Unknown"}, silent),
        # never reported: nothing ran there to lose (nodes registered by hand look like this)
        _node("never", {"type": "Ready", "status": "Unknown", "reason": "NodeStatusNeverUpdated"}),
        # reporting that it is not ready: its processes are still there to report on
        _node("sick", {"type": "Ready", "status": "False", "reason": "KubeletNotReady"}),
        _node("fine", {"type": "Ready", "status": "True", "reason": "KubeletReady"}),
        _node("bare"),
    ]
    got = health.from_lost_nodes(nodes, GPUS)
    assert got.failed == {("gone", i) for i in range(GPUS)}
    assert got.problems == ("node gone: its kubelet stopped reporting (Ready Unknown): its GPUs "
                            "are lost",)
    assert [n["metadata"]["name"] for n in nodes if health.node_lost(n)] == ["gone"]


def test_a_node_gone_from_the_api_or_whose_trainer_pod_leaves_is_lost_too() -> None:
    fine = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
    got = health.from_lost_nodes([_node("a", fine), _node("b", fine)], 2,
                                 placed=["a", "b", "deleted"], leaving=["b"])
    assert got.failed == {("b", 0), ("b", 1), ("deleted", 0), ("deleted", 1)}
    assert got.problems == ("node b: its trainer pod is being deleted: its GPUs are lost",
                            "node deleted: it is gone from the API: its GPUs are lost")


def test_every_node_silent_at_once_is_the_control_planes_view_not_a_loss() -> None:
    silent = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}
    got = health.from_lost_nodes([_node("a", silent), _node("b", silent)], 2)
    assert got.failed == frozenset()
    assert got.problems == ("every node of the job (2) stopped reporting at once: taken for "
                            "the control plane's view, not as lost",)


# -- the ranks the job's node agents saw die ----------------------------------------------------

def _deaths(**by_node: dict[int, float]) -> dict[str, NodeReport | None]:
    return {node: NodeReport(node, 2, 40, 100, State.RECONFIGURING, rank_deaths=deaths)
            for node, deaths in by_node.items()} | {"silent-agent": None}


def test_a_gpu_whose_rank_died_is_lost_at_once_until_dcgm_speaks_after_the_death() -> None:
    reports = _deaths(a={3: NOW - 1.0}, b={})
    # DCGM's verdict on node a is older than the death: the death decides, until the hold ends
    got = health.from_rank_deaths(reports, GPUS, now=NOW, told_at={"a": NOW - 5.0})
    assert got.failed == {("a", 3)}
    assert "its rank died" in got.reasons[("a", 3)]
    assert got.recheck_at == NOW - 1.0 + health.RANK_DEATH_HOLD_S
    assert any("a/3" in line for line in got.problems)
    # a verdict made after the death: DCGM alone decides (failed, or back through a join)
    assert health.from_rank_deaths(reports, GPUS, now=NOW, told_at={"a": NOW}).failed == set()
    # past the hold with nothing newer from DCGM, or without DCGM as a source, it comes back
    later = NOW - 1.0 + health.RANK_DEATH_HOLD_S
    assert health.from_rank_deaths(reports, GPUS, now=later, told_at={}).failed == set()
    held = health.from_rank_deaths(reports, GPUS, now=NOW, told_at=None)
    assert held.failed == {("a", 3)} and held.recheck_at == later
    assert health.from_rank_deaths(reports, GPUS, now=later, told_at=None).failed == set()


def test_a_job_that_restarts_counts_a_death_once_dcgm_has_spoken_or_the_hold_ended() -> None:
    reports = _deaths(a={3: NOW - 1.0})
    waiting = health.from_rank_deaths(reports, GPUS, now=NOW, told_at={"a": NOW - 5.0},
                                      settled=True)
    assert waiting.failed == set() and waiting.recheck_at == NOW - 1.0 + health.RANK_DEATH_HOLD_S
    told = health.from_rank_deaths(reports, GPUS, now=NOW, told_at={"a": NOW}, settled=True)
    assert told.failed == {("a", 3)} and told.recheck_at is None
    later = NOW - 1.0 + health.RANK_DEATH_HOLD_S
    assert health.from_rank_deaths(reports, GPUS, now=later, told_at=None, settled=True
                                   ).failed == {("a", 3)}


def test_a_death_reported_on_no_gpu_of_the_job_or_far_in_the_future_changes_nothing() -> None:
    far = NOW + 2 * health.RANK_DEATH_HOLD_S
    got = health.from_rank_deaths(_deaths(a={GPUS: NOW}, b={1: far}), GPUS, now=NOW,
                                  told_at=None)
    assert got.failed == set() and got.recheck_at is None
    assert got.problems == (f"node b: GPU 1's rank died {far - NOW:.0f} s in the future by its "
                            "agent's clock, ignored",)


def test_the_soonest_recheck_survives_a_merge() -> None:
    first = health.Health(recheck_at=NOW + 5)
    assert first.merge(health.Health()).recheck_at == NOW + 5
    assert health.Health().merge(first).merge(health.Health(recheck_at=NOW + 2)).recheck_at \
        == NOW + 2
    assert health.Health().merge(health.Health()).recheck_at is None


def test_when_each_node_was_last_observed_skips_what_does_not_parse() -> None:
    assert health.observed_at(_read([published("a", at=NOW - 3), {"metadata": {"name": "b"}}, 7])) \
        == {"a": NOW - 3}
