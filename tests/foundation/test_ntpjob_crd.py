"""The NTPTrainingJob CRD on a real apiserver: served, accepts the example, rejects bad specs."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes import client

from tessera_dev import paths

pytestmark = pytest.mark.foundation

GROUP, VERSION, PLURAL = "tessera.dev", "v1alpha1", "ntptrainingjobs"
EXAMPLE = paths.repo_root() / "manifests" / "examples" / "ntpjob-small.yaml"


@pytest.fixture
def jobs(admin_api: client.ApiClient, tessera_crds: list[str]) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(admin_api)


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def kubectl(plane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", "--kubeconfig", str(plane.kubeconfig), *args],
                          capture_output=True, text=True, timeout=60)


def create(jobs: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> dict:
    # Strict, like kubectl: a misspelt field is an error rather than silently dropped
    return jobs.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body, field_validation="Strict")


def test_crd_is_established_with_short_name(tessera_crds, admin_api):
    crd = client.ApiextensionsV1Api(admin_api).read_custom_resource_definition(
        "ntptrainingjobs.tessera.dev")
    assert "ntptrainingjobs.tessera.dev" in tessera_crds
    assert crd.status.accepted_names.short_names == ["ntpjob"]
    assert crd.spec.scope == "Namespaced"


def test_example_job_is_accepted_with_defaults(jobs, namespace):
    created = create(jobs, namespace, example())
    stored = jobs.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, created["metadata"]["name"])
    spec = stored["spec"]
    # what the user wrote comes back unchanged
    for key, value in example()["spec"].items():
        if isinstance(value, dict):
            assert value.items() <= spec[key].items(), key
        else:
            assert spec[key] == value, key
    # and the schema's defaults fill what they left out
    assert spec["scaleUpDomainLabel"] == "nvidia.com/gpu.clique"
    assert spec["powerPolicy"]["ramp"] == {"stepWatts": 25}
    assert 79 in spec["failurePolicy"]["fatalXIDs"]
    assert (spec["steps"], spec["globalBatch"]) == (1000, 64)


def status_body(generation: int) -> dict[str, Any]:
    return {"status": {
        "observedGeneration": generation,
        "phase": "Degraded",
        "layoutGeneration": 3,
        "tpLayout": "8,7",
        "goodput": 0.975,
        "replicas": [
            {"index": 0, "tensorParallelSize": 8, "nodes": ["node-0"]},
            {"index": 1, "tensorParallelSize": 7, "nodes": ["node-1"],
             "failedGPUs": ["node-1/3"], "powerBoosted": True},
        ],
        "conditions": [{
            "type": "Degraded", "status": "True", "observedGeneration": generation,
            "lastTransitionTime": "2026-01-01T00:00:00Z", "reason": "GPUFailed",
            "message": "replica 1 runs at TP7",
        }],
    }}


def test_status_subresource_keeps_every_field(jobs, namespace):
    created = create(jobs, namespace, example())
    name = created["metadata"]["name"]
    body = status_body(created["metadata"]["generation"])
    jobs.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, body)
    stored = jobs.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    assert stored["status"] == body["status"]
    # status is a subresource: writing it through the main resource changes nothing
    stored["status"]["phase"] = "Failed"
    jobs.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, stored)
    again = jobs.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    assert again["status"]["phase"] == "Degraded"


def test_status_with_unknown_phase_is_rejected(jobs, namespace):
    name = create(jobs, namespace, example())["metadata"]["name"]
    body = {"status": {"phase": "Exploded"}}
    with pytest.raises(client.ApiException) as err:
        jobs.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, body)
    assert err.value.status == 422
    assert "status.phase" in json.loads(err.value.body)["message"]


def test_kubectl_get_ntpjob_shows_printer_columns(control_plane, jobs, namespace):
    applied = kubectl(control_plane, "apply", "-n", namespace, "-f", str(EXAMPLE))
    assert applied.returncode == 0, applied.stderr
    name = example()["metadata"]["name"]
    jobs.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, status_body(1))
    shown = kubectl(control_plane, "get", "ntpjob", "-n", namespace)
    assert shown.returncode == 0, shown.stderr
    header, row = shown.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "TP", "LAYOUT", "STEP", "GOODPUT", "AGE"]
    assert row.split()[:4] == [name, "Degraded", "8,7", "0.975"]


def test_kubectl_apply_of_bad_job_names_the_field(control_plane, tessera_crds, namespace, tmp_path):
    bad = example()
    bad["spec"]["powerPolicy"]["boostCapWatts"] = 500
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump(bad))
    applied = kubectl(control_plane, "apply", "-n", namespace, "-f", str(manifest))
    assert applied.returncode != 0
    assert "spec.powerPolicy.boostCapWatts" in applied.stderr
    assert kubectl(control_plane, "get", "ntpjob", "-n", namespace, "-o", "name").stdout == ""


def _parent(spec: dict, path: str) -> tuple[dict, str]:
    """The mapping that holds the dotted path's last key, and that key."""
    *parents, leaf = path.split(".")
    for key in parents:
        spec = spec[key]
    return spec, leaf


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def mutate(spec: dict) -> None:
        parent, leaf = _parent(spec, path)
        parent[leaf] = value
    return mutate


def _drop(path: str) -> Callable[[dict], None]:
    def mutate(spec: dict) -> None:
        parent, leaf = _parent(spec, path)
        del parent[leaf]
    return mutate


def _several(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(spec: dict) -> None:
        for mutation in mutations:
            mutation(spec)
    return mutate


# (mutation of the example's spec, field the server must name, words its message must contain)
INVALID_SPECS = {
    "missing image": (_drop("image"), "spec.image", "Required value"),
    "missing kvHeads": (_drop("model.kvHeads"), "spec.model.kvHeads", "Required value"),
    "TP as a string": (_set("tensorParallelSize", "eight"), "spec.tensorParallelSize",
                       "must be of type integer"),
    "TP zero": (_set("tensorParallelSize", 0), "spec.tensorParallelSize",
                "greater than or equal to 1"),
    "TP above any domain": (_set("tensorParallelSize", 1024), "spec.tensorParallelSize",
                            "less than or equal to 576"),
    "unknown failure mode": (_set("failurePolicy.mode", "RESTART"), "spec.failurePolicy.mode",
                             "Unsupported value"),
    "unknown health source": (_set("failurePolicy.healthSources", ["smart"]),
                              "spec.failurePolicy.healthSources", "are dcgm, cordon and dra"),
    "duplicate health source": (_set("failurePolicy.healthSources", ["dcgm", "dcgm"]),
                                "spec.failurePolicy.healthSources", "each source once"),
    "duplicate fatal XID": (_set("failurePolicy.fatalXIDs", [79, 79]),
                            "spec.failurePolicy.fatalXIDs", "each XID once"),
    "fatal XID out of range": (_set("failurePolicy.fatalXIDs", [79, 70000]),
                               "spec.failurePolicy.fatalXIDs", "from 1 to 65535"),
    "replicas x TP above GPUs": (_set("dataParallelReplicas", 3), "spec.totalGPUs",
                                 "at least dataParallelReplicas x tensorParallelSize"),
    "partial node": (_several(_set("totalGPUs", 20), _set("dataParallelReplicas", 2)),
                     "spec.totalGPUs", "multiple of gpusPerNode"),
    "boost below base": (_set("powerPolicy.boostCapWatts", 500),
                         "spec.powerPolicy.boostCapWatts", "at least baseCapWatts"),
    "base cap below hardware minimum": (_set("powerPolicy.baseCapWatts", 50),
                                        "spec.powerPolicy.baseCapWatts",
                                        "greater than or equal to 200"),
    "NTP-PW without power policy": (_drop("powerPolicy"), "spec.powerPolicy",
                                    "required when failurePolicy.mode is NTP-PW"),
    "min TP above TP": (_set("failurePolicy.minTensorParallelSize", 9),
                        "spec.failurePolicy.minTensorParallelSize", "must not exceed"),
    "heads not divisible by kvHeads": (_set("model.kvHeads", 5), "spec.model.kvHeads",
                                       "multiple of model.kvHeads"),
    "hidden not divisible by heads": (_set("model.hidden", 4100), "spec.model.heads",
                                      "multiple of model.heads"),
    "TP above head count": (_several(_set("model.heads", 4), _set("model.kvHeads", 4),
                                     _set("model.hidden", 4096)),
                            "spec.tensorParallelSize", "must not exceed model.heads"),
    "SPARE without a spare": (_set("failurePolicy.mode", "SPARE"), "spec.totalGPUs",
                              "SPARE needs totalGPUs beyond the active replicas"),
    "no GPUs per node": (_set("gpusPerNode", 0), "spec.gpusPerNode",
                         "greater than or equal to 1"),
    "TP above the vocabulary": (_several(_set("model.vocab", 4)), "spec.tensorParallelSize",
                                "must not exceed model.ffn nor model.vocab"),
    "rack budget below one GPU's minimum": (_set("powerPolicy.rackBudgetWatts", 150),
                                            "spec.powerPolicy.rackBudgetWatts",
                                            "greater than or equal to 200"),
    "misspelt field": (_set("tensorParalelSize", 8), "spec.tensorParalelSize", "unknown field"),
}


@pytest.mark.parametrize("mutate,field,words", INVALID_SPECS.values(), ids=INVALID_SPECS.keys())
def test_invalid_spec_is_rejected_naming_the_field(jobs, namespace, mutate, field, words):
    body = copy.deepcopy(example())
    mutate(body["spec"])
    with pytest.raises(client.ApiException) as err:
        create(jobs, namespace, body)
    message = json.loads(err.value.body)["message"]
    assert err.value.status in (400, 422), message
    assert field in message and words in message, message
    assert "division" not in message and "modulus" not in message, message
    # nothing half-created
    assert jobs.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"] == []


def test_a_name_no_node_label_can_hold_is_rejected(jobs, namespace):
    body = example()
    body["metadata"] = {"name": "j" * 64}
    with pytest.raises(client.ApiException) as err:
        create(jobs, namespace, body)
    message = json.loads(err.value.body)["message"]
    assert err.value.status == 422 and "at most 63 characters" in message, message
    body["metadata"] = {"name": "j" * 63}
    assert create(jobs, namespace, body)["metadata"]["name"] == "j" * 63
