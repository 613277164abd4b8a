"""The CRD's defaults have one source: `jobspec.defaulted` fills a spec exactly as the API server
stores it, and the spec's typed value (`NTPTrainingJobSpec`, what the operator decides from) is
the one the API server stores, for the shipped examples and a minimal job that leaves every
defaulted field out."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import yaml
from kubernetes import client

from tessera_contracts import api
from tessera_contracts.jobspec import NTPTrainingJobSpec, defaulted
from tessera_dev import paths

pytestmark = pytest.mark.foundation

MINIMAL = {
    "image": "tessera-trainer:0.1.0",
    "model": {"hidden": 64, "heads": 4, "kvHeads": 2, "ffn": 128, "vocab": 256, "layers": 2,
              "seqLen": 32},
    "tensorParallelSize": 4, "dataParallelReplicas": 2, "totalGPUs": 8,
}
EXAMPLES = sorted((paths.repo_root() / "manifests" / "examples").glob("*.yaml"))


def _specs() -> list[tuple[str, dict[str, Any]]]:
    found = [("minimal", MINIMAL)]
    found += [(p.name, yaml.safe_load(p.read_text())["spec"]) for p in EXAMPLES]
    # what a family adds to spec.model, a Llama's value written out included
    found.append(("a family's model", {**MINIMAL, "model": {
        **MINIMAL["model"], "headDim": 24, "qkNorm": True, "qkvBias": False,
        "tiedEmbeddings": True, "ropeScaling": {"type": "linear", "factor": 2.0}}}))
    # a job naming an object with defaults inside leaves those to the schema too
    found.append(("partial power policy", {
        **MINIMAL, "failurePolicy": {"mode": "NTP-PW"},
        "powerPolicy": {"baseCapWatts": 500, "boostCapWatts": 700}}))
    return found


@pytest.mark.parametrize(("name", "spec"), _specs(), ids=[n for n, _ in _specs()])
def test_defaulted_spec_and_its_typed_value_are_what_the_api_server_stores(
        name, spec, admin_api, tessera_crds, namespace):
    body = {"apiVersion": api.API_VERSION, "kind": api.JOB_KIND,
            "metadata": {"name": f"d-{uuid.uuid4().hex[:8]}"}, "spec": spec}
    stored = client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.JOB_PLURAL, body, dry_run="All")
    assert defaulted(spec) == stored["spec"]
    # The typed value of the spec as written is the stored spec's, and gives it back whole:
    # no field lost, none defaulted otherwise (the digests of a pod's inputs are taken of it).
    typed = NTPTrainingJobSpec.from_spec(spec)
    assert typed == NTPTrainingJobSpec.from_spec(stored["spec"])
    assert typed.to_spec() == stored["spec"]


def test_defaulting_leaves_the_callers_spec_alone():
    spec = {**MINIMAL, "failurePolicy": {"mode": "DROP"}}
    filled = defaulted(spec)
    assert spec == {**MINIMAL, "failurePolicy": {"mode": "DROP"}}
    assert filled["failurePolicy"]["mode"] == "DROP"  # what the user wrote wins
    assert 79 in filled["failurePolicy"]["fatalXIDs"]
