"""The progress report contract between the trainer pods' agents and the operator: a report
survives its JSON round trip, garbage is a ReportError naming the field, an agent's report says
the device its ranks train on as the trainer picks it, and `summarize` gives the job's phase,
step, goodput, message and its nodes' devices from their reports."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp.distributed import pick_device
from ntp.nodeagent.agent import Devices, rank_device, requested_device
from ntp.nodeagent.progress import RECENT_STEPS, NodeProgress
from tessera_contracts.progress import (
    Device,
    JobProgress,
    NodeReport,
    Phase,
    RankDeath,
    ReportError,
    State,
    progress_configmap,
    read_reports,
    report_key,
    summarize,
)

NODES = ("gpu-node-0", "gpu-node-1", "gpu-node-2")


def report(node: str = "gpu-node-0", state: State = State.TRAINING, **fields) -> NodeReport:
    values = dict(node=node, generation=2, step=40, steps=100, state=state, step_seconds=1.5,
                  compute_seconds=1.25, samples=40 * 64, tokens=40 * 64 * 128, goodput=0.8,
                  productive_seconds=80.0, wall_seconds=100.0,
                  badput_seconds={"startup": 15.0, "reconfiguration": 5.0})
    return NodeReport(**(values | fields))


def test_a_report_round_trips_through_its_json_form():
    original = report(message="generation 2 from step 38")
    assert NodeReport.from_json(original.to_json()) == original
    assert NodeReport.from_dict(json.loads(json.dumps(original.to_dict()))) == original
    # a state given as its string is the enum member, so comparisons by identity hold
    assert report(state="Finished").state is State.FINISHED


def test_the_json_form_leaves_out_what_is_empty():
    # Thousands of reports share one ConfigMap's 1 MiB: zero categories and an empty message
    # are not written, and a node starting up has no step time yet.
    starting = report(state=State.STARTING, step=0, step_seconds=None, compute_seconds=None,
                      badput_seconds={"startup": 3.0, "restart": 0.0})
    document = starting.to_dict()
    assert document["badputSeconds"] == {"startup": 3.0}
    assert "message" not in document and "stepSeconds" not in document
    assert "computeSeconds" not in document
    assert NodeReport.from_dict(document) == starting
    assert len(report(node="a-node-name-of-sixty-three-characters-as-kubernetes-allows-it0")
               .to_json()) < 400


@pytest.mark.parametrize(("document", "names"), [
    ([], "a JSON object"),
    ({"node": "n"}, "missing generation, step, steps, state"),
    (report().to_dict() | {"node": ""}, "node"),
    (report().to_dict() | {"step": -1}, "step"),
    (report().to_dict() | {"step": 3.5}, "step"),
    (report().to_dict() | {"generation": True}, "generation"),
    (report().to_dict() | {"steps": 0}, "steps"),
    (report().to_dict() | {"step": 101}, "past the job's 100 steps"),
    (report().to_dict() | {"state": "Sleeping"}, "state"),
    (report().to_dict() | {"state": ["Training"]}, "state"),
    (report().to_dict() | {"goodput": 1.5}, "goodput"),
    (report().to_dict() | {"wallSeconds": float("nan")}, "wallSeconds"),
    (report().to_dict() | {"wallSeconds": 10**400}, "wallSeconds"),
    (report().to_dict() | {"stepSeconds": "fast"}, "stepSeconds"),
    (report().to_dict() | {"computeSeconds": -0.5}, "computeSeconds"),
    (report().to_dict() | {"computeSeconds": float("inf")}, "computeSeconds"),
    (report().to_dict() | {"computeSeconds": False}, "computeSeconds"),
    (report().to_dict() | {"message": 7}, "message"),
    (report().to_dict() | {"badputSeconds": [1]}, "badputSeconds"),
    (report().to_dict() | {"badputSeconds": {"coffee": 1.0}}, "'coffee' is not one of"),
    (report().to_dict() | {"badputSeconds": {"startup": -1.0}}, "badputSeconds.startup"),
    (report().to_dict() | {"device": "tpu"}, "device: one of cpu, cuda"),
    (report().to_dict() | {"device": ["cpu"]}, "device"),
    (report().to_dict() | {"device": "cuda", "cudaDevices": -1}, "cudaDevices"),
    (report().to_dict() | {"device": "cuda", "cudaDevices": 1.5}, "cudaDevices"),
    (report().to_dict() | {"rankDeaths": [3]}, "rankDeaths: an object of GPU indices"),
    (report().to_dict() | {"rankDeaths": {"-1": 5.0}}, "rankDeaths: an object of GPU indices"),
    (report().to_dict() | {"rankDeaths": {"²": 5.0}}, "rankDeaths: an object of GPU indices"),
    (report().to_dict() | {"rankDeaths": {"3": "now"}}, "rankDeaths.3"),
    (report().to_dict() | {"rankDeaths": {"3": True}}, "rankDeaths.3"),
    (report().to_dict() | {"rankDeaths": {"3": {"step": 4}}}, "rankDeaths.3: an object with at"),
    (report().to_dict() | {"rankDeaths": {"3": {"at": 1.0, "step": -1}}}, "rankDeaths.3.step"),
    (report().to_dict() | {"rankDeaths": {"3": {"at": 1.0, "error": "x" * 301}}},
     "rankDeaths.3.error"),
    (report().to_dict() | {"rankDeaths": {"3": {"at": 1.0, "again": 1}}}, "rankDeaths.3.again"),
])
def test_a_malformed_report_is_a_report_error_naming_the_field(document, names):
    with pytest.raises(ReportError, match=names.replace("(", r"\(")):
        NodeReport.from_dict(document)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=3),
    max_leaves=8)
fields = st.sampled_from(["node", "generation", "step", "steps", "state", "message",
                          "stepSeconds", "computeSeconds", "samples", "tokens", "goodput",
                          "productiveSeconds", "wallSeconds", "badputSeconds", "device",
                          "cudaDevices", "rankDeaths"])


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=6))
def test_any_json_in_place_of_fields_is_a_valid_report_or_a_report_error(changes):
    try:
        parsed = NodeReport.from_dict(report().to_dict() | changes)
    except ReportError:
        return
    assert NodeReport.from_json(parsed.to_json()) == parsed


def test_a_report_names_the_gpus_whose_rank_died_until_a_rank_starts_there_again():
    progress = NodeProgress("gpu-node-0", 100)
    assert progress.report().rank_deaths == {}
    key = progress.key()
    progress.rank_died(3, "pid 7 on gpu-node-0/3 killed by SIGKILL",
                       RankDeath(time.time(), 12, "killed by SIGKILL"))
    died = progress.report()
    assert list(died.rank_deaths) == [3] and died.state is State.RECONFIGURING
    death = died.rank_deaths[3]
    assert abs(death.at - time.time()) < 60  # Unix seconds: DCGM's clock's kind
    assert progress.key() != key  # a report is due at once
    assert NodeReport.from_json(died.to_json()) == died
    assert json.loads(died.to_json())["rankDeaths"] == {"3": {
        "at": death.at, "step": 12, "error": "killed by SIGKILL"}}
    # an agent that says only when reads as it did
    older = NodeReport.from_dict(died.to_dict() | {"rankDeaths": {"3": death.at}})
    assert older.rank_deaths == {3: RankDeath(death.at)}
    progress.rank_started(3)
    assert progress.report().rank_deaths == {}
    assert "rankDeaths" not in progress.report().to_dict()


def test_a_report_says_what_its_ranks_train_on_and_an_older_agents_report_still_reads():
    on_cpu = report(device=Device("cpu", 0))
    assert on_cpu.to_dict()["device"] == "cpu" and on_cpu.to_dict()["cudaDevices"] == 0
    assert NodeReport.from_json(on_cpu.to_json()) == on_cpu
    # An agent that says nothing of it (an older one) writes neither field and reads back so.
    older = report().to_dict()
    assert "device" not in older and "cudaDevices" not in older
    assert NodeReport.from_dict(older).device is None
    assert NodeReport.from_dict(older | {"device": "cuda"}).device == Device("cuda", None)


def test_text_that_is_not_json_is_a_report_error():
    with pytest.raises(ReportError, match="not JSON"):
        NodeReport.from_json("{'node': ")
    assert issubclass(ReportError, ValueError)


def test_the_operator_reads_each_nodes_report_from_the_configmap_data():
    assert progress_configmap("llm") == "llm-progress"
    good = report("gpu-node-0")
    data = {report_key("gpu-node-0"): good.to_json(), report_key("gpu-node-1"): "{garbage",
            report_key("gpu-node-9"): report("gpu-node-9").to_json()}
    assert read_reports(data, NODES) == {"gpu-node-0": good, "gpu-node-1": None,
                                         "gpu-node-2": None}
    assert read_reports(None, NODES[:1]) == {"gpu-node-0": None}


def every(state: State = State.TRAINING, **fields) -> dict[str, NodeReport]:
    return {n: report(n, state, **fields) for n in NODES}


def test_before_any_node_has_trained_the_job_is_pending():
    assert summarize({}, 1, NODES).phase is Phase.PENDING
    starting = {NODES[0]: report(NODES[0], State.STARTING, step=0, generation=1)}
    progress = summarize(starting, 1, NODES)
    assert (progress.phase, progress.step) == (Phase.PENDING, 0)
    assert progress.message == "1/3 nodes started, none has trained yet"


def test_a_job_whose_nodes_all_train_the_published_generation_is_running():
    reports = every()
    reports[NODES[1]] = report(NODES[1], step=41)
    progress = summarize(reports, 2, NODES)
    assert progress == JobProgress(Phase.RUNNING, 40, 100, pytest.approx(0.8),
                                   "step 40/100, generation 2, 3 nodes")


@pytest.mark.parametrize(("change", "why"), [
    ({"generation": 1}, "generation 1"),
    ({"state": State.RECONFIGURING}, "reconfiguring"),
    ({"state": State.STARTING, "step": 0}, "starting"),
])
def test_a_node_behind_the_published_generation_makes_the_job_reconfigure(change, why):
    reports = every()
    reports[NODES[2]] = dataclasses.replace(reports[NODES[2]], **change)
    progress = summarize(reports, 2, NODES)
    assert progress.phase is Phase.RECONFIGURING
    assert progress.message == f"step 40/100, generation 2: waiting for {NODES[2]} ({why})"
    # a node still starting (a joining GPU's) has done no step: the job's step is the others'
    assert progress.step == 40


def test_a_node_without_a_report_makes_the_job_reconfigure():
    reports: dict[str, NodeReport | None] = every()
    reports[NODES[0]] = None
    progress = summarize(reports, 2, NODES)
    assert progress.phase is Phase.RECONFIGURING
    assert "gpu-node-0 (no report)" in progress.message


def test_the_message_names_a_few_waiting_nodes_and_counts_the_rest():
    nodes = [f"n{i}" for i in range(10)]
    progress = summarize({"n0": report("n0")}, 2, nodes)
    assert progress.message.endswith("waiting for n1 (no report), n2 (no report), "
                                     "n3 (no report) and 6 more")


def test_any_failed_node_fails_the_job_with_its_reason():
    reports = every()
    reports[NODES[1]] = report(NODES[1], State.FAILED, message="lost the job's rendezvous")
    reports[NODES[2]] = report(NODES[2], State.FINISHED)
    progress = summarize(reports, 2, NODES)
    assert progress.phase is Phase.FAILED
    assert progress.message == "gpu-node-1 failed: lost the job's rendezvous"


def test_the_job_succeeds_when_every_node_has_finished():
    reports = every(State.FINISHED, step=100)
    assert summarize(reports, 2, NODES).phase is Phase.SUCCEEDED
    reports[NODES[0]] = report(NODES[0], State.TRAINING, step=100)
    assert summarize(reports, 2, NODES).phase is Phase.RUNNING


def test_job_goodput_weights_each_node_by_its_wall_time_including_nodes_that_left():
    reports: dict[str, NodeReport | None] = {
        NODES[0]: report(NODES[0], productive_seconds=90.0, wall_seconds=100.0, goodput=0.9,
                         badput_seconds={"startup": 10.0}),
        NODES[1]: report(NODES[1], productive_seconds=10.0, wall_seconds=300.0, goodput=1 / 30,
                         badput_seconds={"waiting_for_health": 290.0}),
        "gone-node": report("gone-node", productive_seconds=50.0, wall_seconds=100.0,
                            goodput=0.5, step=10),
    }
    progress = summarize(reports, 2, NODES[:2])
    assert progress.goodput == pytest.approx(150.0 / 500.0)
    assert progress.step == 40  # a node that left does not hold the job's step back
    assert summarize({NODES[0]: report(NODES[0], wall_seconds=0.0, productive_seconds=0.0,
                                       goodput=0.0, badput_seconds={})},
                     2, NODES[:1]).goodput is None


def step_line(step: int, rank: int, compute_s: float | None, generation: int = 1) -> bytes:
    """A rank's step line as ntp.report.RankRecord.log_step prints it."""
    line = {"step": step, "rank": rank, "loss": 2.0, "step_s": 1.0, "samples": 64,
            "generation": generation}
    return json.dumps(line if compute_s is None else line | {"compute_s": compute_s}).encode()


def test_a_nodes_report_carries_its_ranks_mean_compute_time_in_the_generation_they_run():
    node = NodeProgress("gpu-node-0", steps=1000, clock=lambda: 0.0)
    assert node.report().compute_seconds is None  # no step yet
    for step in range(1, RECENT_STEPS + 6):
        # the first steps were slower: only the recent ones count
        slow = 1.0 if step <= 5 else 0.0
        node.read(step_line(step, 0, 0.5 + slow))
        node.read(step_line(step, 1, 0.7 + slow))  # every rank counts, not only the first
    assert node.report().compute_seconds == 0.6
    node.read(step_line(RECENT_STEPS + 6, 0, 0.9, generation=2))  # a new layout: afresh
    node.read(step_line(RECENT_STEPS + 6, 1, 9.0, generation=1))  # a late line of the old one
    node.read(step_line(RECENT_STEPS + 6, 2, float("nan"), generation=2))
    assert node.report().compute_seconds == 0.9
    assert NodeReport.from_json(node.report().to_json()).compute_seconds == 0.9
    assert NodeProgress("n", 10).report().to_dict().get("computeSeconds") is None
    older = NodeProgress("gpu-node-1", steps=1000, clock=lambda: 0.0)
    older.read(step_line(1, 0, None))  # a trainer that does not measure it
    assert older.report().compute_seconds is None and older.report().step == 1


def test_the_job_carries_what_the_ranks_of_its_nodes_train_on():
    reports: dict[str, NodeReport | None] = every()
    reports[NODES[0]] = report(NODES[0], device=Device("cpu", 0))
    reports[NODES[1]] = report(NODES[1], device=Device("cuda", 8))
    reports["gone-node"] = report("gone-node", device=Device("cpu", 0))
    # the published generation's nodes that say; not a node that left the job
    assert summarize(reports, 2, NODES).devices == {NODES[0]: Device("cpu", 0),
                                                    NODES[1]: Device("cuda", 8)}
    reports[NODES[2]] = report(NODES[2], State.FAILED, device=Device("cuda", 8))
    assert summarize(reports, 2, NODES).devices[NODES[2]] == Device("cuda", 8)


# (the ranks' --device, the CUDA devices the agent sees, the node's GPU of the rank): the pod
# holds the node's GPUs 4-7, so CUDA numbers them 0-3.
DEVICE_CASES = [("auto", 4, 7), ("auto", 0, 4), ("auto", 2, 6), ("auto", 2, 5), ("cpu", 4, 5),
                ("cuda", 4, 4)]


@pytest.mark.parametrize(("requested", "visible", "gpu"), DEVICE_CASES)
def test_the_agent_reports_the_device_the_trainer_picks(monkeypatch, requested, visible, gpu):
    """The agent's `rank_device`, before it starts a rank, against `ntp.distributed.pick_device`
    as the rank runs it: in the environment `Devices.bind` gives it, where CUDA, restricted to
    CUDA_VISIBLE_DEVICES, has the one device or none."""
    devices = Devices(visible=(4, 5, 6, 7))
    env, _ = devices.bind(gpu)
    seen = 1 if int(env["CUDA_VISIBLE_DEVICES"]) < visible else 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: seen)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: seen > 0)
    for name, value in (env | {"RANK": "5", "WORLD_SIZE": "8"}).items():
        monkeypatch.setenv(name, value)
    picked = pick_device(requested)
    assert rank_device(requested, devices.cuda_index(gpu), visible) == picked.split(":")[0]


def test_under_device_cuda_a_rank_without_one_fails_and_is_reported_as_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="--device cuda needs 1 GPUs"):
        pick_device("cuda")
    assert rank_device("cuda", 0, 0) == "cuda"  # it never trains on CPU


@pytest.mark.parametrize(("args", "device"), [
    ((), "auto"),
    (("--lr=0.01",), "auto"),
    (("--device", "cpu", "--lr", "0.01"), "cpu"),
    (("--device=cpu",), "cpu"),
    (("--device", "cpu", "--device=cuda"), "cuda"),  # the last one, as argparse reads them
    (("--lr", "0.01", "--device"), "auto"),  # no value: the rank refuses its command line
])
def test_the_agent_reads_the_device_the_ranks_are_asked_for(args, device):
    assert requested_device(args) == device


def test_a_node_trains_on_cpu_once_any_of_its_ranks_does():
    node = NodeProgress("gpu-node-0", steps=1000, clock=lambda: 0.0)
    assert node.report().device is None  # no rank started yet
    node.ranks_on(Device("cuda", 3))
    assert node.report().device == Device("cuda", 3)
    node.ranks_on(Device("cpu", 3))
    node.ranks_on(Device("cuda", 3))
    assert node.report().device == Device("cpu", 3)
    assert NodeReport.from_json(node.report().to_json()).device == Device("cpu", 3)
