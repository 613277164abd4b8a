"""The generation contract: the document round-trips, bad documents name their field, and
`origin` follows GPU identity (pure, no processes)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp.model import FLAVORS, ModelArgs
from ntp.sources import assignment
from tessera_contracts.generation import (
    Generation,
    GenerationError,
    Gpu,
    Rendezvous,
    derive_origin,
    next_generation,
)
from tessera_contracts.model_shape import RopeScaling
from tessera_core.plan import JobLayout, generation_layout, plan_job

SHAPE = FLAVORS["debug"].shape()  # 12 query heads, 4 KV heads
STORE = Rendezvous("10.0.0.5", 29500)


def gpus(node: str, n: int) -> tuple[Gpu, ...]:
    return tuple(Gpu(node, i) for i in range(n))


def first_generation(*replicas: tuple[Gpu, ...], mode: str = "NTP") -> Generation:
    return Generation(1, SHAPE, 16, mode, tuple(replicas), STORE)


def test_the_document_round_trips_through_json_in_the_crds_words():
    gen = next_generation(
        first_generation(gpus("gpu-node-0", 4), gpus("gpu-node-1", 4), mode="NTP-PW"),
        (gpus("gpu-node-0", 4), gpus("gpu-node-1", 3)),
        at_step=7,
    )
    document = json.loads(json.dumps(gen.to_dict()))
    assert Generation.from_dict(document) == gen
    # spec.model's field names, failurePolicy.mode's value, GPUs as NODE/INDEX
    assert document["model"] == {
        "hidden": 48, "heads": 12, "kvHeads": 4, "ffn": 40, "vocab": 64, "layers": 2, "seqLen": 16
    }  # fmt: skip
    assert document["mode"] == "NTP-PW"
    assert document["replicas"][1] == {"gpus": ["gpu-node-1/0", "gpu-node-1/1", "gpu-node-1/2"]}
    assert (document["generation"], document["atStep"]) == (2, 7)
    assert document["origin"] == [0, 1, 2, 3, 4, 5, 6]


def test_what_a_family_adds_travels_in_the_document():
    # Qwen3-shaped (its own head size, QK norms, a tied head) with llama3 RoPE: the trainer's
    # model is the document's, and a layout document (asdict) carries it too
    family = replace(SHAPE, head_dim=10, qk_norm=True, tied_embeddings=True,
                     rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    gen = Generation(1, family, 16, "NTP", (gpus("a", 4),), STORE)
    document = json.loads(json.dumps(gen.to_dict()))
    assert document["model"] == SHAPE.to_spec() | {
        "headDim": 10, "qkNorm": True, "tiedEmbeddings": True,
        "ropeScaling": {"type": "llama3", "factor": 8.0, "lowFreqFactor": 1.0,
                        "highFreqFactor": 4.0, "originalMaxPositionEmbeddings": 64}}
    assert Generation.from_dict(document) == gen
    layout = assignment(document).layout
    assert ModelArgs.of_shape(layout.shape).shape() == family
    assert JobLayout.from_dict(json.loads(json.dumps(layout.to_dict()))).shape == family


def test_the_trainer_runs_the_layout_the_planner_gives_for_the_documents_degrees():
    # NTP splits the batch by TP degree, NTP-PW evenly: the trainer plans the same units
    # as tessera_core.plan does for those degrees, so no unit list travels in the document.
    replicas = (gpus("a", 4), gpus("b", 3))
    for mode, rule in (("NTP", "ntp"), ("NTP-PW", "ntp-pw"), ("DROP", "ntp"), ("SPARE", "ntp")):
        gen = Generation(1, SHAPE, 14, mode, replicas, STORE)
        assert assignment(gen.to_dict()).layout == plan_job(SHAPE, [4, 3], 14, rule)


BAD = [
    # (change to a valid document, field the error names)
    (lambda d: d.pop("model"), "model"),
    (lambda d: d["model"].update(kvHeads=5), "model"),
    (lambda d: d["model"].update(layers=0), "model.layers"),
    (lambda d: d["model"].update(qkNorm="yes"), "model"),
    (lambda d: d["model"].update(slidingWindow=8), "model"),  # shorter than seqLen 16
    (lambda d: d["model"].update(ropeScaling={"type": "yarn", "factor": 4.0}), "model"),
    (lambda d: d.update(mode="ntp"), "mode"),
    (lambda d: d.update(schemaVersion=2), "schemaVersion"),
    (lambda d: d.update(kind="NTPLayout"), "kind"),
    (lambda d: d.update(generation=0), "generation"),
    (lambda d: d.update(globalBatch="16"), "globalBatch"),
    (lambda d: d["replicas"][0]["gpus"].append("gpu-node-1"), "replicas[0].gpus[4]"),
    (lambda d: d["replicas"][1]["gpus"].append("a/0"), "replicas"),
    (lambda d: d.update(replicas=[]), "replicas"),
    (lambda d: d.update(origin=[0, 1]), "origin"),
    (lambda d: d.update(origin=[0, 0, 1, 2, 3, 4, 5, 6]), "origin"),
    (lambda d: d.pop("origin"), "origin"),
    (lambda d: d.update(atStep=-1), "atStep"),
    (lambda d: d["rendezvous"].update(port=70000), "rendezvous.port"),
    (lambda d: d.pop("rendezvous"), "rendezvous"),
]


@pytest.mark.parametrize(("change", "field"), BAD)
def test_a_bad_document_names_its_field(change, field):
    document = next_generation(
        first_generation(gpus("a", 4), gpus("b", 4)), (gpus("a", 4), gpus("b", 4))
    ).to_dict()
    change(document)
    with pytest.raises(GenerationError) as err:
        Generation.from_dict(document)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_a_degree_the_model_cannot_take_is_refused_when_planned():
    gen = first_generation(gpus("a", 13))  # 12 query heads: a 13th rank would hold none
    with pytest.raises(GenerationError) as err:
        generation_layout(gen)
    assert err.value.field == "replicas"


def test_the_process_on_the_same_gpu_carries_on():
    before = first_generation(gpus("a", 4), gpus("b", 4))
    lost = Gpu("b", 2)
    after = [gpus("a", 4), tuple(g for g in gpus("b", 4) if g != lost)]
    assert derive_origin(before, after) == (0, 1, 2, 3, 4, 5, 7)
    # the GPU back: a fresh process (None) where nobody ran before
    healed = next_generation(next_generation(before, after), (gpus("a", 4), gpus("b", 4)))
    assert healed.origin == (0, 1, 2, 3, 4, 5, None, 6)
    # a process that died on a GPU still in the layout starts afresh too
    assert derive_origin(before, (gpus("a", 4),), lost={Gpu("a", 1)}) == (0, None, 2, 3)


@st.composite
def relayouts(draw):
    """A previous layout and a new one drawn over some of its GPUs and some new ones."""
    n_before = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    before = tuple(gpus(f"n{r}", n) for r, n in enumerate(n_before))
    pool = [g for r in before for g in r] + list(gpus("fresh", 4))
    chosen = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=len(pool), unique=True))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(chosen) - 1)), max_size=3)))
    bounds = [0, *[c for c in cuts if c < len(chosen)], len(chosen)]
    after = tuple(tuple(chosen[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if a < b)
    lost = draw(st.sets(st.sampled_from(pool), max_size=2))
    return first_generation(*before), after, lost


@given(relayouts())
def test_origin_maps_exactly_the_surviving_processes(case):
    before, after, lost = case
    origin = derive_origin(before, after, lost)
    new_gpus = [g for r in after for g in r]
    assert len(origin) == len(new_gpus)
    kept = [o for o in origin if o is not None]
    assert len(set(kept)) == len(kept)  # no process becomes two ranks
    for gpu, old in zip(new_gpus, origin, strict=True):
        if old is None:
            assert gpu in lost or gpu not in before.gpus
        else:  # the same GPU, and its process did not die
            assert before.gpus[old] == gpu and gpu not in lost
