"""What crosses between processes, as typed values: each writer's form reads back as written,
and a reader refuses what does not follow the contract with the field (or option) named, never
with anything else: the node's GPUHealth object, a rank's step and event lines, and the node
agent's and a rank's command lines."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera_contracts import gpuhealth
from tessera_contracts.gpuhealth import (
    GpuHealth,
    MalformedHealth,
    NodeHealth,
    PublishedHealth,
    State,
)
from tessera_contracts.invocation import (
    METRICS_PORT,
    RANK_OPTIONS,
    AgentInvocation,
    InvocationError,
    RankInvocation,
)
from tessera_contracts.rank_events import (
    EvalRecord,
    EventKind,
    RankEvent,
    RecordError,
    StepRecord,
    parse_line,
)

pytestmark = pytest.mark.foundation

# --- the GPUHealth object -----------------------------------------------------------------

OBSERVED = 1_700_000_000.0  # whole seconds: the object's time has no fraction
NODE_HEALTH = NodeHealth((
    GpuHealth(0, State.HEALTHY),
    GpuHealth(1, State.HEALTHY, "recent XID 13, 79: each job's fatalXIDs decide", xids=(13, 79)),
    GpuHealth(2, State.FAILED, "DCGM health watch MEM: DCGM_FR_VOLATILE_DBE_DETECTED"),
    GpuHealth(3, State.UNKNOWN, "no health series for this GPU"),
))
PUBLISHED = PublishedHealth("gpu-node-0", "http://10.0.0.1:9400/metrics", OBSERVED, NODE_HEALTH)


def test_a_gpu_health_object_reads_back_as_its_agent_wrote_it() -> None:
    body = gpuhealth.render(PUBLISHED)
    assert body["kind"] == "GPUHealth" and body["metadata"] == {"name": "gpu-node-0"}
    status = body["status"]
    assert status["observedAt"] == "2023-11-14T22:13:20.000Z"
    assert (status["failedGPUs"], status["xidGPUs"], status["unknownGPUs"]) == ("2", "1", "3")
    assert status["gpus"][1] == {"index": 1, "state": "Healthy", "xids": [13, 79],
                                 "reason": "recent XID 13, 79: each job's fatalXIDs decide"}
    assert gpuhealth.parse(json.loads(json.dumps(body))) == PUBLISHED
    unreachable = PublishedHealth("n", "http://x/metrics", OBSERVED, NodeHealth(
        (), error="exporter unreachable: connection refused"))
    assert gpuhealth.render(unreachable)["status"]["exporter"]["error"] == \
        "exporter unreachable: connection refused"
    assert gpuhealth.parse(gpuhealth.render(unreachable)) == unreachable


def test_what_the_crd_bounds_is_clipped_on_the_way_out() -> None:
    long = PublishedHealth("n", "u", OBSERVED, NodeHealth(
        (GpuHealth(0, State.FAILED, "x" * 5000, xids=tuple(range(1, 101))),), error="e" * 5000))
    status = gpuhealth.render(long)["status"]
    assert len(status["gpus"][0]["reason"]) == gpuhealth.MAX_REASON
    assert len(status["exporter"]["error"]) == gpuhealth.MAX_REASON
    assert status["gpus"][0]["xids"] == list(range(1, gpuhealth.MAX_XIDS + 1))


def _body(**status: Any) -> dict[str, Any]:
    body = gpuhealth.render(PUBLISHED)
    body["status"] |= status
    return body


@pytest.mark.parametrize(("obj", "node", "field"), [
    ("a string", None, "object"),
    ({"status": {}}, None, "metadata.name"),
    ({"metadata": {"name": 7}}, None, "metadata.name"),
    ({"metadata": {"name": "n"}}, "n", "status"),
    ({"metadata": {"name": "n"}, "status": []}, "n", "status"),
    (_body(observedAt="yesterday"), "gpu-node-0", "status.observedAt"),
    (_body(observedAt=10**5000), "gpu-node-0", "status.observedAt"),
    (_body(observedAt="2023-11-14T22:13:20.000Z" * 10), "gpu-node-0", "status.observedAt"),
])
def test_an_object_no_reader_can_use_is_refused_with_the_field(obj: object, node: str | None,
                                                               field: str) -> None:
    with pytest.raises(MalformedHealth) as refused:
        gpuhealth.parse(obj)
    assert (refused.value.node, refused.value.field) == (node, field)
    assert str(refused.value).startswith(f"{field}: ") and len(str(refused.value)) < 200


@pytest.mark.parametrize(("status", "problem"), [
    ({"gpus": "all"}, "status.gpus: not a list"),
    ({"exporter": "down"}, "status.exporter: not an object"),
    ({"exporter": {"url": 5}}, "status.exporter.url: not a string"),
    ({"exporter": {"url": "u", "error": 5}}, "status.exporter.error: not a string"),
    ({"gpus": [{"index": "0", "state": "Failed"}]}, "an entry without a GPU index"),
    ({"gpus": [{"index": True, "state": "Failed"}]}, "an entry without a GPU index"),
    ({"gpus": ["x" * 10_000]}, "an entry without a GPU index (xxxxxxxx...(10000 characters))"),
    ({"gpus": [{"index": 64, "state": "Failed"}]}, "an entry with GPU index 64, not 0-63"),
    ({"gpus": [{"index": 10**5000}]}, "an entry with GPU index <int>, not 0-63"),
    ({"gpus": [{"index": 0, "state": "Healthy"}, {"index": 0, "state": "Failed"}]},
     "GPU 0 listed twice"),
    ({"gpus": [{"index": 0, "state": "Healthy", "xids": ["79", None, True, 2**80, 79, 79]}]},
     "GPU 0: xids: 5 not XIDs"),
    ({"gpus": [{"index": 0, "state": "Healthy", "xids": list(range(1, 70))}]},
     "GPU 0: xids: 5 past the first 64"),
    ({"gpus": [{"index": 0, "state": "Healthy", "reason": ["no"]}]}, "GPU 0: reason: not a"),
])
def test_what_parsing_skips_is_named_in_the_problems(status: dict[str, Any],
                                                     problem: str) -> None:
    read = gpuhealth.parse(_body(**status))
    assert any(line.startswith(problem) for line in read.health.problems), read.health.problems
    assert read.node == "gpu-node-0" and read.observed_at == OBSERVED  # the rest still reads


def test_what_no_reader_needs_may_be_left_out() -> None:
    body = gpuhealth.render(PUBLISHED)
    del body["status"]["exporter"], body["status"]["failedGPUs"]
    for gpu in body["status"]["gpus"]:
        del gpu["xids"], gpu["reason"]
    read = gpuhealth.parse(body)
    assert read.health.problems == () and read.exporter_url == ""
    assert [(g.index, g.state) for g in read.health.gpus] == [
        (g.index, g.state) for g in PUBLISHED.health.gpus]


def test_a_state_it_cannot_read_is_unknown_with_that_state_as_the_reason() -> None:
    read = gpuhealth.parse(_body(gpus=[{"index": 0, "state": "Broken", "xids": [79]},
                                       {"index": 1}]))
    assert read.health.gpus == (GpuHealth(0, State.UNKNOWN, "state Broken", xids=(79,)),
                                GpuHealth(1, State.UNKNOWN, "state None"))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                               max_size=5),
    max_leaves=30,
)
GPU_ENTRY = st.fixed_dictionaries({}, optional={
    "index": st.integers(-5, 70) | JSON, "state": st.sampled_from(
        ["Healthy", "Failed", "Unknown"]) | JSON,
    "xids": st.lists(st.integers(-1, 2**40) | JSON, max_size=5) | JSON, "reason": JSON})


@settings(max_examples=300, deadline=None)
@given(gpus=st.lists(GPU_ENTRY, max_size=8) | JSON, observed=st.sampled_from(
    ["2023-11-14T22:13:20.000Z", "2023-11-14T22:13:20.5+02:00", "2023-13-40T99:99:99Z"]) | JSON,
    exporter=st.fixed_dictionaries({}, optional={"url": JSON, "error": JSON}) | JSON)
def test_any_object_parses_or_is_refused_with_a_reason(gpus: object, observed: object,
                                                       exporter: object) -> None:
    obj = {"metadata": {"name": "n"},
           "status": {"observedAt": observed, "exporter": exporter, "gpus": gpus}}
    try:
        read = gpuhealth.parse(obj)
    except MalformedHealth as refused:
        assert refused.node == "n" and refused.field == "status.observedAt"
        return
    assert all(0 <= g.index < gpuhealth.MAX_GPUS and len(g.reason) <= gpuhealth.MAX_REASON
               for g in read.health.gpus)
    assert [g.index for g in read.health.gpus] == sorted({g.index for g in read.health.gpus})
    assert gpuhealth.parse(gpuhealth.render(read)).health.gpus == read.health.gpus


# --- a rank's lines ----------------------------------------------------------------------

STEP = StepRecord(step=7, rank=3, generation=2, loss=2.5, step_s=0.25, samples=64,
                  tokens=64 * 128, compute_s=0.2, tp_degrees=(4, 3))
EVENTS = [
    RankEvent(EventKind.RECONFIGURED, 3, 2, 7, (4, 3), 1_700_000_000.5),
    RankEvent(EventKind.RESTORING, 0, 3, 6, (4, 4), 1_700_000_001.0, None, "no survivor"),
    RankEvent(EventKind.RESTORED, 0, 3, 5, (4, 4), 1_700_000_002.0, "/ckpt/run/step-00000005",
              "why"),
    RankEvent(EventKind.SAVING_CHECKPOINT, 1, 1, 10, (2,), 1.0),
    RankEvent(EventKind.CHECKPOINTED, 1, 1, 10, (2,), 2.0),
]


TIMED = StepRecord(1, 0, 0, 1.0, 0.1, 8, time=1_700_000_003.25)
EVAL = EvalRecord(step=20, rank=1, generation=2, eval_loss=3.25, samples=32,
                  time=1_700_000_004.5)


@pytest.mark.parametrize("record", [STEP, StepRecord(1, 0, 0, 1.0, 0.1, 8), TIMED, *EVENTS,
                                    EVAL, EvalRecord(5, 0, 1, 4.0, 8)])
def test_a_rank_record_reads_back_as_printed(record: StepRecord | RankEvent | EvalRecord) -> None:
    line = record.to_line()
    assert "\n" not in line and line.startswith("{")
    assert parse_line(line) == record
    assert parse_line((line + "\n").encode()) == record


def test_the_lines_keep_the_form_every_reader_of_the_logs_knows() -> None:
    assert json.loads(STEP.to_line()) == {
        "step": 7, "rank": 3, "loss": 2.5, "step_s": 0.25, "compute_s": 0.2, "samples": 64,
        "tokens": 8192, "tp_degrees": [4, 3], "generation": 2}
    assert json.loads(EVENTS[1].to_line()) == {
        "event": "restoring", "generation": 3, "step": 6, "tp_degrees": [4, 4],
        "time": 1_700_000_001.0, "checkpoint": None, "why": "no survivor", "rank": 0}
    assert "checkpoint" not in json.loads(EVENTS[0].to_line())
    assert json.loads(TIMED.to_line())["time"] == 1_700_000_003.25  # when the step ended
    assert json.loads(EVAL.to_line()) == {
        "step": 20, "rank": 1, "generation": 2, "eval_loss": 3.25, "samples": 32,
        "time": 1_700_000_004.5}


def test_a_diverged_loss_is_a_step_all_the_same() -> None:
    line = StepRecord(1, 0, 1, math.nan, 0.1, 8).to_line()
    read = parse_line(line)
    assert isinstance(read, StepRecord) and math.isnan(read.loss)


@pytest.mark.parametrize("line", [
    "", "loss at step 3: 2.5", "{not JSON", "[1, 2]", '{"message": "a JSON log line"}',
    b"\xff\xfe{", b"{\xff}", "{" * 100_000,
])
def test_a_line_that_is_no_record_is_passed_over(line: str | bytes) -> None:
    assert parse_line(line) is None


def _mangled(record: StepRecord | RankEvent, **change: object) -> str:
    d = record.to_dict()
    for key, value in change.items():
        if value is _DROP:
            del d[key]
        else:
            d[key] = value
    return json.dumps(d)


_DROP = object()


@pytest.mark.parametrize(("record", "change", "field"), [
    (STEP, {"step": "one"}, "step"),
    (STEP, {"step": -1}, "step"),
    (STEP, {"rank": True}, "rank"),
    (STEP, {"generation": _DROP}, "generation"),
    (STEP, {"samples": -1}, "samples"),
    (STEP, {"samples": 1.5}, "samples"),
    (STEP, {"tokens": "many"}, "tokens"),
    (STEP, {"loss": "2.5"}, "loss"),
    (STEP, {"loss": 10**400}, "loss"),
    (STEP, {"step_s": -0.1}, "step_s"),
    (STEP, {"step_s": _DROP}, "step_s"),
    (STEP, {"time": "now"}, "time"),
    (STEP, {"compute_s": math.inf}, "compute_s"),
    (STEP, {"tp_degrees": [4, 0]}, "tp_degrees"),
    (STEP, {"tp_degrees": "4,3"}, "tp_degrees"),
    (EVENTS[0], {"event": "exploded"}, "event"),
    (EVENTS[0], {"event": None}, "event"),
    (EVENTS[0], {"step": _DROP}, "step"),
    (EVENTS[0], {"rank": _DROP}, "rank"),
    (EVENTS[0], {"time": "now"}, "time"),
    (EVENTS[0], {"tp_degrees": _DROP}, "tp_degrees"),
    (EVENTS[1], {"checkpoint": 3}, "checkpoint"),
    (EVENTS[1], {"why": ["x"]}, "why"),
    (EVAL, {"eval_loss": "3.25"}, "eval_loss"),
    (EVAL, {"samples": _DROP}, "samples"),
    (EVAL, {"step": -2}, "step"),
    (EVAL, {"time": -1}, "time"),
])
def test_a_malformed_record_is_refused_with_the_field(record: StepRecord | RankEvent,
                                                      change: dict[str, object],
                                                      field: str) -> None:
    with pytest.raises(RecordError) as refused:
        parse_line(_mangled(record, **change))
    assert refused.value.field == field and str(refused.value).startswith(f"{field}: ")
    assert len(str(refused.value)) < 200


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(
    ["event", "step", "rank", "loss", "generation", "step_s", "compute_s", "samples", "tokens",
     "tp_degrees", "time", "checkpoint", "why", "eval_loss"]), JSON | st.integers(0, 10)))
def test_any_line_is_a_record_no_record_or_refused_with_a_reason(record: dict) -> None:
    try:
        read = parse_line(json.dumps(record))
    except RecordError:
        return
    if read is not None:
        assert parse_line(read.to_line()) == read or isinstance(read, StepRecord) and \
            math.isnan(read.loss) or isinstance(read, EvalRecord) and math.isnan(read.eval_loss)


# --- command lines -------------------------------------------------------------------------


def test_the_agent_reads_the_command_line_the_operator_writes() -> None:
    written = AgentInvocation(until_step=100_000, job="tiny-llama",
                              trainer_args=("--save", "/ckpt/run", "--lr=0.01"))
    assert written.to_args() == ["--job", "tiny-llama", "--until-step", "100000", "--",
                                 "--save", "/ckpt/run", "--lr=0.01"]
    assert AgentInvocation.from_args(written.to_args()) == written
    every = AgentInvocation(until_step=12, generations=Path("/jobs/llm/generations"),
                            node="gpu-node-1", namespace="team-a", work_dir=Path("/tmp/w"),
                            metrics_port=0, job="llm")
    assert AgentInvocation.from_args(every.to_args()) == every
    assert AgentInvocation(until_step=1, job="j").metrics_port == METRICS_PORT


@pytest.mark.parametrize(("argv", "message"), [
    (["--job", "j"], "the following arguments are required: --until-step"),
    (["--job", "j", "--until-step", "ten"], "argument --until-step: invalid int value"),
    (["--job", "j", "--until-step", "0"], "--until-step must be at least 1, got 0"),
    (["--until-step", "5"], "one of --job or --generations is required"),
    (["--job", "j", "--until-step", "5", "--metrics-port", "70000"], "--metrics-port must be"),
    # a count is a rank's, never the agent's; and no option is taken for another's prefix
    (["--job", "j", "--steps", "5"], "the following arguments are required: --until-step"),
    (["--job", "j", "--until-step", "5", "--steps", "5"], "unrecognized arguments: --steps 5"),
    (["--job", "j", "--until", "5"], "the following arguments are required: --until-step"),
    (["--job", "j", "--until-step", "5", "--", "--lr", "1", "--until-step=3", "--join"],
     "the agent sets --until-step=3, --join for each rank itself"),
])
def test_an_agent_command_line_off_the_contract_is_refused_with_the_option(
        argv: list[str], message: str) -> None:
    with pytest.raises(InvocationError, match="^" + message.replace("(", r"\(")):
        AgentInvocation.from_args(argv)


def test_a_rank_reads_the_command_line_its_agent_writes() -> None:
    written = RankInvocation(Path("/work/gen3.json"), Path("/work"), until_step=100, join=True,
                             options=("--out", "/out", "--lr=0.01", "--save-every", "5"))
    assert written.to_args()[:7] == ["--layout", "/work/gen3.json", "--layout-dir", "/work",
                                     "--until-step", "100", "--join"]
    assert RankInvocation.from_args(written.to_args()) == written
    # the invocation's options wherever they are; the trainer's keep their order
    read = RankInvocation.from_args(["--lr", "0.1", "--steps", "3", "--out", "o",
                                     "--layout=g.json"])
    assert read == RankInvocation(Path("g.json"), steps=3, options=("--lr", "0.1", "--out", "o"))


def test_the_agent_refuses_after_its_dashes_each_option_it_writes_for_its_ranks() -> None:
    written = [*RankInvocation(Path("g"), Path("d"), steps=1, join=True).to_args(),
               *RankInvocation(Path("g"), until_step=1).to_args()]
    assert {a for a in written if a.startswith("--")} == set(RANK_OPTIONS)
    for option in RANK_OPTIONS:
        with pytest.raises(InvocationError, match=f"the agent sets {option} for each rank"):
            AgentInvocation.from_args(["--job", "j", "--until-step", "5", "--", option])


def test_a_ranks_steps_are_a_count_or_the_jobs_last_step() -> None:
    assert RankInvocation(Path("g"), until_step=100).until(start=40) == 100
    assert RankInvocation(Path("g"), steps=3).until(start=40) == 43
    assert RankInvocation(Path("g")).until(start=40) == 50


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "3"], "--layout is required"),
    (["--layout", "g", "--steps", "3", "--until-step", "5"],
     "argument --until-step: not allowed with argument --steps"),
    (["--layout", "g", "--until-step", "-1"], "--until-step must be at least 0, got -1"),
    (["--layout", "g", "--steps", "x"], "argument --steps: invalid int value"),
])
def test_a_rank_command_line_off_the_contract_is_refused_with_the_option(
        argv: list[str], message: str) -> None:
    with pytest.raises(InvocationError, match="^" + message):
        RankInvocation.from_args(argv)
