"""The job API's guard rails on a real API server: what the operator owns in the pod template is
refused with the field named, the checkpoints, the dataset and the initial weights need a mounted
volume, and a running job's shape and starting weights are immutable while its other fields stay
editable."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes import client

from tessera_contracts.api import GROUP, JOB_PLURAL, VERSION
from tessera_dev import paths

pytestmark = pytest.mark.jobapi

EXAMPLE = paths.repo_root() / "manifests" / "examples" / "ntpjob-small.yaml"


@pytest.fixture
def jobs(admin_api: client.ApiClient, tessera_crds: list[str]) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(admin_api)


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def trainer(spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in spec["template"]["spec"]["containers"] if c["name"] == "trainer")


def create(jobs: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> dict:
    return jobs.create_namespaced_custom_object(GROUP, VERSION, namespace, JOB_PLURAL, body,
                                                field_validation="Strict")


def refusal(call: Callable[[], object]) -> str:
    with pytest.raises(client.ApiException) as err:
        call()
    assert err.value.status == 422, err.value.body
    return str(json.loads(err.value.body)["message"])


# (mutation of the example's spec, the field the server must name, words of its message)
OPERATOR_OWNED: dict[str, tuple[Callable[[dict], None], str, str]] = {
    "nodeName": (lambda s: s["template"]["spec"].update(nodeName="n1"),
                 "spec.template.spec.nodeName", "places trainer pods"),
    "node affinity": (lambda s: s["template"]["spec"].update(affinity={"nodeAffinity": {}}),
                      "spec.template.spec.affinity.nodeAffinity", "pins each trainer pod"),
    "restartPolicy": (lambda s: s["template"]["spec"].update(restartPolicy="Always"),
                      "spec.template.spec.restartPolicy", "maxRestarts"),
    "no API token": (lambda s: s["template"]["spec"].update(automountServiceAccountToken=False),
                     "spec.template.spec.automountServiceAccountToken", "node agent"),
    "trainer image": (lambda s: trainer(s).update(image="other:1"),
                      "spec.template.spec.containers[0]", "spec.image"),
    "trainer NODE_NAME": (lambda s: trainer(s)["env"].append({"name": "NODE_NAME", "value": "x"}),
                          "spec.template.spec.containers[0]", "NODE_NAME"),
    "a GPU request": (lambda s: trainer(s)["resources"].update(limits={"nvidia.com/gpu": 8}),
                      "spec.template.spec.containers[0]", "gpusPerNode"),
    "the shm volume": (lambda s: s["template"]["spec"]["volumes"].append(
        {"name": "tessera-shm", "emptyDir": {}}), "spec.template.spec.volumes", "tessera-shm"),
    "an operator label": (lambda s: s["template"].update(metadata={
        "labels": {"tessera.dev/job": "other"}}), "spec.template.metadata.labels",
        "tessera.dev/"),
    "a scrape annotation": (lambda s: s["template"]["metadata"]["annotations"].update({
        "prometheus.io/port": "1"}), "spec.template.metadata.annotations", "prometheus.io/"),
    "a checkpoint on no volume": (lambda s: s["checkpointPolicy"].update(path="/elsewhere/x"),
                                  "spec.checkpointPolicy.path", "volume the trainer container"),
    "a checkpoint on a read-only mount": (
        lambda s: trainer(s)["volumeMounts"][0].update(readOnly=True),
        "spec.checkpointPolicy.path", "writable"),
    "a checkpoint on a path's prefix only": (
        lambda s: s["checkpointPolicy"].update(path="/checkpoints-other/run"),
        "spec.checkpointPolicy.path", "volume the trainer container"),
}


def refused_naming(jobs: client.CustomObjectsApi, namespace: str, mutate: Callable[[dict], None],
                   field: str, words: str) -> None:
    """The example, mutated, is refused with `field` and `words` in the message; nothing made."""
    body = example()
    mutate(body["spec"])
    message = refusal(lambda: create(jobs, namespace, body))
    assert field in message and words in message, message
    assert jobs.list_namespaced_custom_object(GROUP, VERSION, namespace, JOB_PLURAL)[
        "items"] == []


@pytest.mark.parametrize("mutate,field,words", OPERATOR_OWNED.values(),
                         ids=OPERATOR_OWNED.keys())
def test_what_the_operator_owns_is_refused_naming_the_field(jobs, namespace, mutate, field,
                                                            words):
    refused_naming(jobs, namespace, mutate, field, words)


# What the ranks read and how they train: (mutation, the field named, words of the message).
TRAINER_INPUTS: dict[str, tuple[Callable[[dict], None], str, str]] = {
    "a dataset on no volume": (lambda s: s["data"].update(path="/elsewhere/fineweb"),
                               "spec.data.path", "volume the trainer container mounts"),
    "a dataset on a path's prefix only": (lambda s: s["data"].update(path="/data-other/d"),
                                          "spec.data.path", "volume the trainer container"),
    "a dataset without a path": (lambda s: s.update(data={"tokenizer": "/data/t.json"}),
                                 "spec.data.path", "Required value"),
    "a tokenizer on no volume": (lambda s: s["data"].update(tokenizer="/tmp/tokenizer.json"),
                                 "spec.data.tokenizer", "volume the trainer container mounts"),
    "initial weights on no volume": (
        lambda s: s["initialWeights"].update(path="/weights/llama-3-8b"),
        "spec.initialWeights.path", "volume the trainer container mounts"),
    "a precision the trainer lacks": (lambda s: s.update(precision="fp16"),
                                      "spec.precision", '"fp32", "bf16"'),
    "no checkpoint kept": (lambda s: s["checkpointPolicy"].update(keep=0),
                           "spec.checkpointPolicy.keep", "greater than or equal to 1"),
    "too many checkpoints kept": (lambda s: s["checkpointPolicy"].update(keep=1001),
                                  "spec.checkpointPolicy.keep", "less than or equal to 1000"),
    "a micro-batch of none": (lambda s: s.update(microBatchSize=0),
                              "spec.microBatchSize", "greater than or equal to 1"),
    "a checkpointing mode the trainer lacks": (
        lambda s: s.update(activationCheckpointing={"mode": "offload"}),
        "spec.activationCheckpointing.mode", '"none", "full", "selective"'),
    "a learning rate of zero": (lambda s: s.update(optimizer={"learningRate": 0}),
                                "spec.optimizer.learningRate", "greater than 0"),
    "a wsd schedule with no decay": (
        lambda s: s.update(optimizer={"schedule": {"type": "wsd", "warmupSteps": 10}}),
        "spec.optimizer.schedule.decaySteps", "must be set for the wsd schedule"),
    "an evaluation with no period": (lambda s: s.update(eval={"samples": 8}),
                                     "spec.eval.everySteps", "Required value"),
    "a GPU memory that is no quantity": (lambda s: s.update(gpuMemory="80 GB"),
                                         "spec.gpuMemory", "should match"),
}


@pytest.mark.parametrize("mutate,field,words", TRAINER_INPUTS.values(),
                         ids=TRAINER_INPUTS.keys())
def test_what_the_trainers_cannot_read_or_run_is_refused_naming_the_field(jobs, namespace,
                                                                          mutate, field, words):
    refused_naming(jobs, namespace, mutate, field, words)


# A model no trainer computes: (mutation, the field named, words of the message).
MODELS: dict[str, tuple[Callable[[dict], None], str, str]] = {
    "heads not dividing hidden, no headDim": (lambda s: s["model"].update(heads=24, kvHeads=8),
                                              "spec.model.heads", "unless model.headDim"),
    "a window shorter than the sequence": (lambda s: s["model"].update(slidingWindow=4096),
                                           "spec.model.slidingWindow", "must not exceed"),
    "llama3 scaling without its band": (
        lambda s: s["model"].update(ropeScaling={"type": "llama3", "factor": 8}),
        "spec.model.ropeScaling", "lowFreqFactor < highFreqFactor"),
    "dynamic scaling past its length": (
        lambda s: s["model"].update(ropeScaling={"type": "dynamic", "factor": 2,
                                                 "originalMaxPositionEmbeddings": 4096}),
        "spec.model.ropeScaling", "longest sequence"),
    "a scaling the trainer lacks": (
        lambda s: s["model"].update(ropeScaling={"type": "yarn", "factor": 4}),
        "spec.model.ropeScaling.type", "Unsupported value"),
}


@pytest.mark.parametrize("mutate,field,words", MODELS.values(), ids=MODELS.keys())
def test_a_model_no_trainer_computes_is_refused_naming_the_field(jobs, namespace, mutate, field,
                                                                 words):
    refused_naming(jobs, namespace, mutate, field, words)


def test_the_families_are_spec_models_and_as_immutable(jobs, namespace):
    """Qwen3-8B (its own head size, QK norms) and Llama 3.2 3B (llama3 RoPE, a tied head) as
    `tessera import-hf` prints them; what a family adds is part of the model."""
    qwen3 = {"hidden": 4096, "heads": 32, "kvHeads": 8, "ffn": 12288, "vocab": 151936,
             "layers": 36, "seqLen": 8192, "headDim": 128, "qkNorm": True}
    llama32 = {"hidden": 3072, "heads": 24, "kvHeads": 8, "ffn": 8192, "vocab": 128256,
               "layers": 28, "seqLen": 8192, "tiedEmbeddings": True,
               "ropeScaling": {"type": "llama3", "factor": 32.0, "lowFreqFactor": 1.0,
                               "highFreqFactor": 4.0, "originalMaxPositionEmbeddings": 8192}}
    for name, model in (("qwen3", qwen3), ("llama32", llama32)):
        body = example()
        body["metadata"]["name"] = name
        body["spec"]["model"] = model
        created = create(jobs, namespace, body)
        assert created["spec"]["model"] == model
        edited = copy.deepcopy(created)
        edited["spec"]["model"]["qkvBias"] = True
        message = refusal(lambda: jobs.replace_namespaced_custom_object(
            GROUP, VERSION, namespace, JOB_PLURAL, name, edited))  # noqa: B023
        assert "spec.model" in message and "immutable" in message, message


def test_a_job_on_a_dataset_from_imported_weights_in_bf16_is_accepted(jobs, namespace):
    """The example reads its dataset, tokenizer and weights from a read-only mount (only the
    checkpoints need a writable one); without those fields the trainers train synthetic
    sequences from random weights in fp32, keeping 3 checkpoints."""
    body = example()
    spec = body["spec"]
    assert next(m for m in trainer(spec)["volumeMounts"] if m["mountPath"] == "/data")[
        "readOnly"] is True
    stored = create(jobs, namespace, body)["spec"]
    for field in ("data", "initialWeights", "precision", "checkpointPolicy"):
        assert stored[field] == spec[field], field
    bare = example()
    bare["metadata"]["name"] = "bare"
    for field in ("data", "initialWeights", "precision"):
        del bare["spec"][field]
    del bare["spec"]["checkpointPolicy"]["keep"]
    stored = create(jobs, namespace, bare)["spec"]
    assert "data" not in stored and "initialWeights" not in stored
    assert stored["precision"] == "fp32" and stored["checkpointPolicy"]["keep"] == 3


def test_the_template_carries_what_training_pods_need(jobs, namespace):
    """Fields the schema does not list (securityContext, resourceClaims, envFrom, ...) are kept
    as written, for the API server to check when the pods are made."""
    body = example()
    pod = body["spec"]["template"]["spec"]
    pod |= {"securityContext": {"runAsNonRoot": True, "seccompProfile": {
                "type": "RuntimeDefault"}},
            "imagePullSecrets": [{"name": "registry"}], "schedulerName": "custom",
            "resourceClaims": [{"name": "domain", "resourceClaimTemplateName": "imex"}]}
    trainer(body["spec"]).update(envFrom=[{"secretRef": {"name": "keys"}}],
                                 securityContext={"allowPrivilegeEscalation": False})
    created = create(jobs, namespace, body)
    stored = created["spec"]["template"]["spec"]
    assert stored["resourceClaims"] == pod["resourceClaims"]
    assert stored["securityContext"] == pod["securityContext"]
    assert trainer(created["spec"])["envFrom"] == [{"secretRef": {"name": "keys"}}]
    assert created["spec"]["suspend"] is False
    assert created["spec"]["failurePolicy"]["maxRestarts"] == 3


IMMUTABLE: dict[str, Callable[[dict], None]] = {
    "model": lambda s: s["model"].update(hidden=8192),
    "tensorParallelSize": lambda s: s.update(tensorParallelSize=4),
    "dataParallelReplicas": lambda s: s.update(dataParallelReplicas=1),
    "pipelineParallelSize": lambda s: s.update(pipelineParallelSize=2, totalGPUs=32),
    "gpusPerNode": lambda s: s.update(gpusPerNode=4),
    "totalGPUs": lambda s: s.update(totalGPUs=24),
    "scaleUpDomainLabel": lambda s: s.update(scaleUpDomainLabel="rack"),
    "managedBy": lambda s: s.update(managedBy="kueue.x-k8s.io/multikueue"),
    "template.spec.serviceAccountName": lambda s: s["template"]["spec"].update(
        serviceAccountName="trainers"),
    "initialWeights": lambda s: s["initialWeights"].update(path="/data/weights/other"),
}


@pytest.mark.parametrize("field", IMMUTABLE)
def test_each_immutable_field_is_refused_with_its_name(jobs, namespace, field):
    created = create(jobs, namespace, example())
    edited = copy.deepcopy(created)
    IMMUTABLE[field](edited["spec"])
    name = created["metadata"]["name"]
    message = refusal(lambda: jobs.replace_namespaced_custom_object(
        GROUP, VERSION, namespace, JOB_PLURAL, name, edited))
    assert f"spec.{field}" in message and "immutable" in message, message
    assert jobs.get_namespaced_custom_object(GROUP, VERSION, namespace, JOB_PLURAL, name)[
        "spec"] == created["spec"]


@pytest.mark.parametrize("had", [True, False], ids=["removed", "added"])
def test_initial_weights_can_be_neither_added_nor_removed(jobs, namespace, had):
    """Every attempt without a checkpoint starts from them: a job's weights descend from one
    start."""
    body = example()
    weights = body["spec"].pop("initialWeights")
    if had:
        body["spec"]["initialWeights"] = weights
    created = create(jobs, namespace, body)
    edited = copy.deepcopy(created)
    if had:
        del edited["spec"]["initialWeights"]
    else:
        edited["spec"]["initialWeights"] = weights
    message = refusal(lambda: jobs.replace_namespaced_custom_object(
        GROUP, VERSION, namespace, JOB_PLURAL, created["metadata"]["name"], edited))
    assert "spec.initialWeights" in message and "immutable" in message, message


def test_the_other_fields_stay_editable(jobs, namespace):
    """What the operator applies live (power, health, the failure policy), at the next attempt
    (image, args, steps, the template, checkpoints, the dataset, the precision) or at once
    (suspend, TTL) may change."""
    created = create(jobs, namespace, example())
    edited = copy.deepcopy(created)
    spec = edited["spec"]
    spec |= {"image": "tessera-trainer:0.2.0", "args": ["--lr=0.0001"], "steps": 2000,
             "globalBatch": 128, "suspend": True, "ttlSecondsAfterFinished": 600}
    spec["powerPolicy"]["boostCapWatts"] = 650
    spec["failurePolicy"] |= {"mode": "NTP", "maxRestarts": 5, "fatalXIDs": [79]}
    spec["checkpointPolicy"] |= {"intervalSteps": 100, "keep": 10}
    spec["data"] = {"path": "/data/datasets/the-stack"}
    spec["precision"] = "fp32"
    spec["template"]["spec"]["tolerations"].append({"key": "x", "operator": "Exists"})
    replaced = jobs.replace_namespaced_custom_object(
        GROUP, VERSION, namespace, JOB_PLURAL, created["metadata"]["name"], edited)
    assert replaced["spec"] == spec
