"""What a job runs, as the operator writes it (pure): the trainer pods from the spec and its pod
template, the rendezvous pod, the trainer identity, which spec edits a running pod lacks, and
placement by free GPUs and NVLink domain."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from ntp.cli import parse_args
from tessera_contracts.api import ATTEMPT_LABEL, INPUTS_ANNOTATION, JOB_LABEL, ROLE_LABEL
from tessera_contracts.invocation import AgentInvocation, RankInvocation
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_dev import demo_data, paths
from tessera_operator import workload
from tessera_operator.planner import JobSpec, Problem

pytestmark = pytest.mark.operator

# Without the example's dataset: each test adds the data, volumes and mounts it checks.
EXAMPLE = demo_data.without_dataset(
    yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-local.yaml").read_text()))
DOMAIN = "nvidia.com/gpu.clique"
SHM_VOLUME = {"name": "tessera-shm", "emptyDir": {"medium": "Memory"}}
SHM_MOUNT = {"name": "tessera-shm", "mountPath": "/dev/shm"}


def _job(pod: Mapping[str, Any] | None = None, trainer: Mapping[str, Any] | None = None,
         metadata: Mapping[str, Any] | None = None,
         sidecars: Sequence[Mapping[str, Any]] = (), **spec: Any) -> dict[str, Any]:
    """The example job with `spec` set; given any of `pod` (the template's pod spec but its
    containers), `trainer` (containers[name=trainer] but its name), `metadata` and `sidecars`,
    a template made of them in place of the example's."""
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] |= {"namespace": "team-a", "uid": "uid-1"}
    job["spec"] |= spec
    if pod is not None or trainer is not None or metadata is not None or sidecars:
        containers = [{"name": "trainer", **copy.deepcopy(dict(trainer or {}))},
                      *copy.deepcopy(list(sidecars))]
        job["spec"]["template"] = {"metadata": copy.deepcopy(dict(metadata or {})),
                                   "spec": copy.deepcopy(dict(pod or {})) | {
                                       "containers": containers}}
    return job


def _spec(job: Mapping[str, Any]) -> NTPTrainingJobSpec:
    return NTPTrainingJobSpec.from_spec(job["spec"])


def _trainer(pod: Mapping[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")


def test_the_trainer_pod_carries_the_specs_fields_and_its_template() -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    job = _job(image="registry.example/trainer:7", command=["python", "-m", "ntp.nodeagent"],
               args=["--lr=0.01"], checkpointPolicy={"path": "/ckpt/run/", "intervalSteps": 50},
               pod={"tolerations": [toleration], "nodeSelector": {"pool": "a"}},
               trainer={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                        "resources": {"requests": {"cpu": "4", "memory": "8Gi"},
                                      "limits": {"memory": "16Gi"}}})
    before = copy.deepcopy(job)
    pod = workload.trainer_pod(job, _spec(job), 1, "node-x")
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "tiny-llama-node-1" and meta["namespace"] == "team-a"
    assert meta["labels"] == {JOB_LABEL: "tiny-llama", ROLE_LABEL: "trainer",
                              ATTEMPT_LABEL: "0"}
    assert workload.controlled_by(pod, job)
    (container,) = spec["containers"]
    assert container["image"] == "registry.example/trainer:7"
    assert container["command"] == ["python", "-m", "ntp.nodeagent"]
    # The agent's own options, then every rank's: the checkpoint directory the spec names (the
    # CRD's default of 3 kept), the precision (the CRD's default), its args.
    rank = ["--save", "/ckpt/run/", "--resume", "--save-every", "50", "--keep", "3",
            "--precision", "fp32", "--activation-checkpointing", "none",
            "--activation-checkpointing-every", "2", "--lr", "0.001", "--weight-decay", "0.1",
            "--lr-schedule", "constant", "--warmup-steps", "0", "--decay-steps", "0",
            "--min-lr-ratio", "0.1", "--lr=0.01"]
    assert container["args"] == ["--job", "tiny-llama", "--until-step", "100000", "--", *rank]
    # what the node agent reads from them: the job, its steps in all, every rank's options
    assert AgentInvocation.from_args(container["args"]) == AgentInvocation(
        until_step=100_000, job="tiny-llama", trainer_args=tuple(rank))
    # All the node's GPUs, as a limit and (requests being given) a request.
    assert container["resources"] == {
        "requests": {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "4"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": "4"}}
    # The downward API's variables first, so the template's may refer to them as $(NODE_NAME).
    assert container["env"] == [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "NCCL_DEBUG", "value": "INFO"}]
    assert {"name": "metrics", "containerPort": workload.METRICS_PORT} in container["ports"]
    assert spec["tolerations"] == [toleration] and spec["nodeSelector"] == {"pool": "a"}
    assert spec["serviceAccountName"] == "tiny-llama-trainer"
    assert spec["restartPolicy"] == "Never"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["node-x"]}]}]
    assert workload.placed_nodes([pod], job) == {1: "node-x"}
    assert workload.node_selector(_spec(job)) == {"pool": "a"}
    # The job is not changed by building pods from it.
    assert job == before


def _trainer_options(job: Mapping[str, Any]) -> argparse.Namespace:
    """Every rank's options as the trainer reads them (`ntp.cli.parse_args`) from the pod's
    command line, the node agent's invocation in between."""
    args = _trainer(workload.trainer_pod(job, _spec(job), 0, "node-x"))["args"]
    options = AgentInvocation.from_args(args).trainer_args
    _, opts = parse_args(RankInvocation(Path("gen1.json"), options=options).to_args())
    return opts


def test_the_ranks_train_on_the_dataset_from_the_weights_and_at_the_precision_of_the_spec() -> None:
    job = _job(checkpointPolicy={"path": "/checkpoints/run", "intervalSteps": 200, "keep": 5},
               data={"path": "/data/fineweb", "tokenizer": "/data/tokenizer.json"},
               initialWeights={"path": "/weights/llama-3.1-8b"}, precision="bf16",
               args=["--lr=0.0003"])
    opts = _trainer_options(job)
    assert (opts.save, opts.resume, opts.save_every, opts.keep) == (
        Path("/checkpoints/run"), True, 200, 5)
    assert (opts.init, opts.data, opts.tokenizer) == (
        Path("/weights/llama-3.1-8b"), Path("/data/fineweb"), Path("/data/tokenizer.json"))
    assert (opts.precision, opts.lr) == ("bf16", 0.0003)


def test_without_data_weights_or_checkpoints_the_ranks_train_on_synthetic_sequences() -> None:
    opts = _trainer_options(_job())
    assert (opts.save, opts.resume, opts.init, opts.data, opts.tokenizer) == (
        None, False, None, None, None)
    assert opts.precision == "fp32"
    # A dataset without its tokenizer; the initial weights without checkpoints.
    opts = _trainer_options(_job(data={"path": "/data/d"}, initialWeights={"path": "/w"}))
    assert (opts.data, opts.tokenizer, opts.init, opts.save) == (
        Path("/data/d"), None, Path("/w"), None)


def test_the_ranks_shard_their_optimizer_state_when_the_spec_says_so() -> None:
    assert _trainer_options(_job(optimizer={"shardedState": True})).sharded_state
    assert not _trainer_options(_job()).sharded_state


def test_the_ranks_take_the_micro_batches_recomputation_recipe_and_evaluation_of_the_spec(
        ) -> None:
    opts = _trainer_options(_job(
        microBatchSize=2, activationCheckpointing={"mode": "selective", "every": 3},
        optimizer={"learningRate": 3e-4, "weightDecay": 0.05, "weightDecayAll": True,
                   "schedule": {"type": "wsd", "warmupSteps": 100, "decaySteps": 400,
                                "minRatio": 0.0}},
        eval={"everySteps": 50, "samples": 16}))
    assert (opts.micro_batch_size, opts.activation_checkpointing,
            opts.activation_checkpointing_every) == (2, "selective", 3)
    assert (opts.lr, opts.weight_decay, opts.weight_decay_all) == (3e-4, 0.05, True)
    assert (opts.lr_schedule, opts.warmup_steps, opts.decay_steps, opts.min_lr_ratio) == (
        "wsd", 100, 400, 0.0)
    assert (opts.eval_every, opts.eval_samples) == (50, 16)
    # The CRD's defaults: the whole share at once, nothing recomputed, a constant rate, no
    # evaluation.
    opts = _trainer_options(_job())
    assert (opts.micro_batch_size, opts.activation_checkpointing, opts.lr_schedule,
            opts.eval_every) == (None, "none", "constant", 0)


def test_the_specs_args_come_last_and_win_over_the_operators() -> None:
    opts = _trainer_options(_job(precision="bf16", args=["--precision", "fp32"]))
    assert opts.precision == "fp32"


def test_the_templates_labels_and_annotations_reach_the_trainer_pod_under_the_operators() -> None:
    job = _job(metadata={
        "labels": {"team": "nlp", JOB_LABEL: "theirs", ROLE_LABEL: "x", ATTEMPT_LABEL: "9"},
        "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net", "prometheus.io/port": "1",
                        "prometheus.io/scrape": "false", INPUTS_ANNOTATION: "{}"}})
    pod = workload.trainer_pod(job, _spec(job), 0, "node-x", attempt=2)
    assert pod["metadata"]["labels"] == {"team": "nlp", JOB_LABEL: "tiny-llama",
                                         ROLE_LABEL: "trainer", ATTEMPT_LABEL: "2"}
    annotations = pod["metadata"]["annotations"]
    assert annotations["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
    # Prometheus scrapes the trainers' metrics port whatever the template says.
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(workload.METRICS_PORT)
    # The pod says what it was made from, so an edit of the spec is seen as not in it yet.
    assert workload.outdated(pod, _spec(job)) == []


def test_what_the_template_gives_the_trainer_pod_passes_through() -> None:
    volumes = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}},
               {"name": "data", "csi": {"driver": "blob.csi.example", "readOnly": True}}]
    pod_fields = {
        "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "training",
        "schedulerName": "gang-scheduler",
        "resourceClaims": [{"name": "ib", "resourceClaimTemplateName": "ib-nic"}],
        "initContainers": [{"name": "warm-cache", "image": "busybox:1.36",
                            "command": ["sh", "-c", "true"]}],
    }
    trainer = {
        "volumeMounts": [{"name": "checkpoints", "mountPath": "/checkpoints"},
                         {"name": "data", "mountPath": "/data", "readOnly": True}],
        "envFrom": [{"configMapRef": {"name": "nccl-tuning"}}],
        "env": [{"name": "HF_TOKEN",
                 "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
                {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"add": ["IPC_LOCK"]}},
        "ports": [{"name": "debug", "containerPort": 5678}],
        "workingDir": "/workspace",
    }
    job = _job(pod=pod_fields, trainer=trainer,
               checkpointPolicy={"path": "/checkpoints/run", "intervalSteps": 100})
    pod = workload.trainer_pod(job, _spec(job), 0, "node-x")
    spec, container = pod["spec"], _trainer(pod)
    for name in ("securityContext", "imagePullSecrets", "priorityClassName", "schedulerName",
                 "resourceClaims", "initContainers"):
        assert spec[name] == pod_fields[name], name
    # The template's volumes and mounts, and the operator's /dev/shm after them.
    assert spec["volumes"] == [*volumes, SHM_VOLUME]
    assert container["volumeMounts"] == [*trainer["volumeMounts"], SHM_MOUNT]
    assert container["envFrom"] == trainer["envFrom"]
    assert container["env"][3:] == trainer["env"]
    assert container["securityContext"] == trainer["securityContext"]
    assert container["workingDir"] == "/workspace"
    assert container["ports"] == [{"name": "debug", "containerPort": 5678},
                                  {"name": "metrics", "containerPort": workload.METRICS_PORT}]


def test_the_trainer_container_can_use_the_pods_resource_claims() -> None:
    """A DRA claim of the pod (an RDMA NIC, say) reaches the trainer only through its
    container's resources.claims: both pass through, the GPUs added beside them."""
    claims = [{"name": "ib"}, {"name": "ib-2", "request": "nic"}]
    job = _job(pod={"resourceClaims": [{"name": "ib", "resourceClaimTemplateName": "ib-nic"},
                                       {"name": "ib-2", "resourceClaimName": "nic-2"}]},
               trainer={"resources": {"requests": {"cpu": "8"}, "claims": claims}})
    resources = _trainer(workload.trainer_pod(job, _spec(job), 0, "node-x"))["resources"]
    assert resources == {"requests": {"cpu": "8", "nvidia.com/gpu": "4"},
                         "limits": {"nvidia.com/gpu": "4"}, "claims": claims}


def test_sidecar_containers_run_after_the_trainer_as_the_template_gives_them() -> None:
    shipper = {"name": "log-shipper", "image": "fluent-bit:3.0",
               "volumeMounts": [{"name": "logs", "mountPath": "/logs"}]}
    job = _job(pod={"volumes": [{"name": "logs", "emptyDir": {}}]},
               trainer={"volumeMounts": [{"name": "logs", "mountPath": "/logs"}]})
    # The template lists the sidecar first: the trainer still comes first in the pod.
    job["spec"]["template"]["spec"]["containers"].insert(0, shipper)
    pod = workload.trainer_pod(job, _spec(job), 0, "node-x")
    assert [c["name"] for c in pod["spec"]["containers"]] == ["trainer", "log-shipper"]
    # A sidecar gets none of the trainer's: no GPU, no operator variables, no /dev/shm.
    assert pod["spec"]["containers"][1] == shipper
    assert workload.placed_nodes([pod], job) == {0: "node-x"}


@pytest.mark.parametrize("mount_path", ["/dev/shm", "/dev/shm/"])
def test_a_memory_backed_dev_shm_unless_the_template_mounts_its_own(mount_path: str) -> None:
    pod = workload.trainer_pod(_job(), _spec(_job()), 0, "node-x")
    assert pod["spec"]["volumes"] == [SHM_VOLUME]
    assert _trainer(pod)["volumeMounts"] == [SHM_MOUNT]
    own = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}
    mount = {"name": "shm", "mountPath": mount_path}
    mounted = _job(pod={"volumes": [own]}, trainer={"volumeMounts": [mount]})
    pod = workload.trainer_pod(mounted, _spec(mounted), 0, "node-x")
    assert pod["spec"]["volumes"] == [own]
    assert _trainer(pod)["volumeMounts"] == [mount]


FULL_TEMPLATE = {
    "pod": {
        "nodeSelector": {"pool": "a"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                         "effect": "NoSchedule"}],
        "priorityClassName": "training",
        "schedulerName": "gang-scheduler",
        "imagePullSecrets": [{"name": "registry"}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}}],
        "resourceClaims": [{"name": "ib", "resourceClaimTemplateName": "ib-nic"}],
        "initContainers": [{"name": "warm-cache", "image": "busybox:1.36"}],
        "hostIPC": True,
    },
    "trainer": {
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "envFrom": [{"secretRef": {"name": "tokens"}}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": "/checkpoints"}],
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
    },
    "metadata": {"labels": {"team": "nlp"},
                 "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"}},
    "sidecars": [{"name": "log-shipper", "image": "fluent-bit:3.0"}],
}


def test_the_rendezvous_pod_takes_only_what_places_and_starts_it_from_the_template() -> None:
    pod_fields = FULL_TEMPLATE["pod"]
    job = _job(**FULL_TEMPLATE)
    pod = workload.rendezvous_pod(job, _spec(job), attempt=1)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "tiny-llama-rendezvous" and workload.controlled_by(pod, job)
    assert meta["labels"] == {"team": "nlp", JOB_LABEL: "tiny-llama",
                              ROLE_LABEL: "rendezvous", ATTEMPT_LABEL: "1"}
    assert "annotations" not in meta
    kept = ("nodeSelector", "tolerations", "priorityClassName", "schedulerName",
            "imagePullSecrets", "securityContext")
    assert {k: spec[k] for k in kept} == {k: pod_fields[k] for k in kept}
    # No volume, no claim, no init container, no host namespace; no API access.
    assert set(spec) == {*kept, "serviceAccountName", "automountServiceAccountToken",
                         "restartPolicy", "containers"}
    assert spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Always"
    (container,) = spec["containers"]
    assert container["name"] == "rendezvous" and container["image"] == job["spec"]["image"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}}
    # No GPU, no mount, nothing of the trainer container; its only variable is its pod IP, the
    # one address it listens on.
    assert not {"resources", "envFrom", "volumeMounts"} & set(container)
    assert container["env"] == [{"name": "POD_IP",
                                 "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert container["args"] == ["--host", "$(POD_IP)", "--port", str(workload.RENDEZVOUS_PORT)]
    assert workload.placed_nodes([pod], job) == {}
    assert workload.pod_node(pod) is None


def test_template_affinity_is_kept_beside_the_operators_pin() -> None:
    spread = {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 10, "podAffinityTerm": {"labelSelector": {"matchLabels": {"team": "nlp"}},
                                          "topologyKey": "kubernetes.io/hostname"}}]}
    near = {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {"app": "dataset-cache"}},
        "topologyKey": "topology.kubernetes.io/zone"}]}
    job = _job(pod={"affinity": {"podAntiAffinity": spread, "podAffinity": near}})
    pod = workload.trainer_pod(job, _spec(job), 0, "node-x")
    affinity = pod["spec"]["affinity"]
    assert affinity["podAntiAffinity"] == spread and affinity["podAffinity"] == near
    assert workload.pod_node(pod) == "node-x"
    # The rendezvous goes wherever the scheduler puts it: never pinned.
    assert workload.pod_node(workload.rendezvous_pod(job, _spec(job))) is None


def test_the_trainer_identity_reads_its_layout_and_patches_its_progress_only() -> None:
    account, role, binding = workload.identity(_job(), _spec(_job()))
    assert account["kind"] == "ServiceAccount" and account["metadata"]["name"] == \
        "tiny-llama-trainer"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["tiny-llama-layout"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["configmaps"],
         "resourceNames": ["tiny-llama-progress"], "verbs": ["get", "patch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-llama-trainer",
                                    "namespace": "team-a"}]


def test_a_template_service_account_takes_the_place_of_the_operators() -> None:
    job = _job(pod={"serviceAccountName": "llm-runner"})
    spec = _spec(job)
    assert workload.trainer_pod(job, spec, 0, "node-x")["spec"]["serviceAccountName"] == \
        "llm-runner"
    assert workload.rendezvous_pod(job, spec)["spec"]["serviceAccountName"] == "llm-runner"
    # No account of the operator's: the user's is bound the same rights.
    role, binding = workload.identity(job, _spec(job))
    (_, own_role, _) = workload.identity(_job(), _spec(_job()))
    assert role == own_role
    assert binding["kind"] == "RoleBinding" and binding["metadata"]["name"] == \
        "tiny-llama-trainer"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "tiny-llama-trainer"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llm-runner",
                                    "namespace": "team-a"}]


TEMPLATE_EDIT = {"spec": {"containers": [
    {"name": "trainer", "env": [{"name": "NCCL_DEBUG", "value": "WARN"}]}]}}
OUTDATING = {
    "unchanged": ({}, []),
    "image": ({"image": "tessera-trainer:0.2.0"}, ["image"]),
    "command": ({"command": ["python", "-m", "mine"]}, ["command"]),
    "args": ({"args": ["--lr=0.01"]}, ["args"]),
    "steps": ({"steps": 5}, ["steps"]),
    "checkpointPolicy": ({"checkpointPolicy": {"path": "/ckpt", "intervalSteps": 10}},
                         ["checkpointPolicy"]),
    "data": ({"data": {"path": "/data/d"}}, ["data"]),
    "initialWeights": ({"initialWeights": {"path": "/w"}}, ["initialWeights"]),
    "precision": ({"precision": "bf16"}, ["precision"]),
    "microBatchSize": ({"microBatchSize": 4}, ["microBatchSize"]),
    "activationCheckpointing": ({"activationCheckpointing": {"mode": "full"}},
                                ["activationCheckpointing"]),
    "optimizer": ({"optimizer": {"schedule": {"type": "cosine", "warmupSteps": 10}}},
                  ["optimizer"]),
    "eval": ({"eval": {"everySteps": 100}}, ["eval"]),
    "the template's container": ({"template": TEMPLATE_EDIT}, ["template"]),
    "the template's labels": ({"template": {"metadata": {"labels": {"team": "nlp"}},
                                            "spec": TEMPLATE_EDIT["spec"]}}, ["template"]),
    "image and template": ({"template": TEMPLATE_EDIT, "image": "tessera-trainer:0.2.0"},
                           ["image", "template"]),
    # What the pods are not made from leaves them current.
    "suspend, TTL, batch, power and failure policies": ({
        "suspend": True, "ttlSecondsAfterFinished": 60, "globalBatch": 16,
        "powerPolicy": EXAMPLE["spec"]["powerPolicy"] | {"boostCapWatts": 650},
        "failurePolicy": EXAMPLE["spec"]["failurePolicy"] | {"maxRestarts": 9}}, []),
}


@pytest.mark.parametrize(("edits", "fields"), OUTDATING.values(), ids=OUTDATING.keys())
def test_a_pod_is_outdated_by_exactly_the_spec_fields_edited_since_it_was_made(
        edits: dict[str, Any], fields: list[str]) -> None:
    job = _job(trainer={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]})
    pod = workload.trainer_pod(job, _spec(job), 0, "node-x")
    edited = NTPTrainingJobSpec.from_spec(copy.deepcopy(job["spec"]) | edits)
    assert workload.outdated(pod, edited) == fields


def test_a_pod_that_does_not_say_what_it_was_made_from_is_outdated_in_every_field() -> None:
    pod = workload.trainer_pod(_job(), _spec(_job()), 0, "node-x")
    del pod["metadata"]["annotations"][INPUTS_ANNOTATION]
    assert workload.outdated(pod, _spec(_job())) == list(workload.POD_INPUTS)
    pod["metadata"]["annotations"][INPUTS_ANNOTATION] = "not json"
    assert workload.outdated(pod, _spec(_job())) == list(workload.POD_INPUTS)


def test_every_pod_and_the_progress_configmap_carry_their_attempt() -> None:
    job = _job()
    spec = _spec(job)
    made = [workload.trainer_pod(job, spec, 0, "node-x", attempt=3),
            workload.rendezvous_pod(job, spec, 3), workload.progress_configmap(job, 3)]
    assert [workload.attempt_of(obj) for obj in made] == [3, 3, 3]
    assert [workload.attempt_of(obj) for obj in (
        workload.trainer_pod(job, spec, 0, "node-x"), workload.rendezvous_pod(job, spec),
        workload.progress_configmap(job))] == [0, 0, 0]
    assert workload.attempt_of({"metadata": {"labels": {}}}) is None
    assert workload.attempt_of({"metadata": {"labels": {ATTEMPT_LABEL: "x"}}}) is None
    assert workload.attempt_of({}) is None


def _node(name: str, gpus: int, domain: str | None = None, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels | ({DOMAIN: domain} if domain else {})},
            "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def _pod_on(node: str, gpus: int, phase: str = "Running") -> dict[str, Any]:
    return {"spec": {"nodeName": node, "containers": [
        {"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}, "status": {"phase": phase}}


def test_placement_counts_gpus_other_pods_hold_and_skips_unusable_nodes() -> None:
    nodes = [_node("a", 8), _node("b", 8), _node("c", 8), _node("d", 8, pool="other"),
             _node("e", 8) | {"spec": {"unschedulable": True}}]
    pods = [_pod_on("a", 2), _pod_on("b", 8, phase="Succeeded")]
    views = workload.node_views(nodes, workload.taken_gpus(pods), {}, DOMAIN)
    assert {v.name: v.free_gpus for v in views} == {"a": 6, "b": 8, "c": 8, "d": 8}
    spec = JobSpec.of(_spec(_job(gpusPerNode=8, totalGPUs=16)))
    assert workload.place(spec, 2, views) == ("b", "c")
    selected = workload.node_views(nodes, workload.taken_gpus(pods), {"pool": "other"}, DOMAIN)
    problem = workload.place(spec, 2, selected)
    assert isinstance(problem, Problem) and problem.reason == "Unschedulable"
    assert "found 1 such nodes of 1" in problem.message


def test_placement_keeps_tp_groups_inside_a_domain() -> None:
    # TP 8 over nodes of 4 GPUs: a group takes two nodes of one domain. Domain x has three
    # nodes (one group, one node left over), y has two: two groups, from y and x.
    nodes = [_node(f"x{i}", 4, "x") for i in range(3)] + [_node(f"y{i}", 4, "y")
                                                         for i in range(2)]
    spec = JobSpec.of(_spec(_job(tensorParallelSize=8, dataParallelReplicas=2, gpusPerNode=4,
                                 totalGPUs=16, model=EXAMPLE["spec"]["model"] | {
                                     "heads": 8, "kvHeads": 2})))
    views = workload.node_views(nodes, {}, {}, DOMAIN)
    assert workload.place(spec, 4, views) == ("x0", "x1", "y0", "y1")
    # Without the domain label every node is its own domain: no group fits.
    alone = workload.node_views([_node(f"n{i}", 4) for i in range(4)], {}, {}, DOMAIN)
    problem = workload.place(spec, 4, alone)
    assert isinstance(problem, Problem) and "in 4 domains" in problem.message


def test_a_trainer_pod_being_deleted_marks_its_node_as_leaving() -> None:
    job = _job()
    going = workload.trainer_pod(job, _spec(job), 0, "node-a")
    going["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
    staying = workload.trainer_pod(job, _spec(job), 1, "node-b")
    rendezvous = workload.rendezvous_pod(job, _spec(job)) | {
        "spec": {"nodeName": "node-c"}}
    rendezvous["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
    other = workload.trainer_pod(_job() | {"metadata": job["metadata"] | {"uid": "uid-2"}},
                                 _spec(_job()), 2, "node-d")
    other["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
    assert workload.leaving_nodes([going, staying, rendezvous, other], job) == {"node-a"}


def test_a_job_takes_whole_nodes_only() -> None:
    # a: two GPUs asked for by another pod; b: more GPUs than the job's per node; c: the rest
    # of the node held by a rendezvous pod, which asks for no GPU
    nodes = [_node("a", 8), _node("b", 16), _node("c", 8), _node("d", 8)]
    pods = [_pod_on("a", 2), _pod_on("c", 0)]
    spec = JobSpec.of(_spec(_job(gpusPerNode=8, totalGPUs=16)))
    views = workload.node_views(nodes, workload.taken_gpus(pods), {}, DOMAIN)
    assert workload.place(spec, 2, views) == ("c", "d")
    problem = workload.place(spec, 3, views)
    assert isinstance(problem, Problem) and "whole nodes" in problem.message
    assert "found 2 such nodes of 4" in problem.message
