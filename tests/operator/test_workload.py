"""What a job runs, as the operator writes it (pure): the trainer pods from the spec's template
fields, the rendezvous pod, the trainer identity, and placement by free GPUs and NVLink domain."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tessera_contracts.invocation import AgentInvocation
from tessera_dev import paths
from tessera_operator import workload
from tessera_operator.planner import JobSpec, Problem

pytestmark = pytest.mark.operator

EXAMPLE = yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-local.yaml").read_text())
DOMAIN = "nvidia.com/gpu.clique"


def _job(**spec: Any) -> dict[str, Any]:
    job = copy.deepcopy(EXAMPLE)
    job["metadata"] |= {"namespace": "team-a", "uid": "uid-1"}
    job["spec"] |= spec
    return job


def test_the_trainer_pod_carries_the_specs_template_fields() -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    job = _job(image="registry.example/trainer:7", command=["python", "-m", "ntp.nodeagent"],
               args=["--lr=0.01"], env=[{"name": "NCCL_DEBUG", "value": "INFO"},
                                        {"name": "NODE_NAME", "value": "mine"}],
               tolerations=[toleration], nodeSelector={"pool": "a"},
               resources={"requests": {"cpu": "4", "memory": "8Gi"},
                          "limits": {"memory": "16Gi"}},
               checkpointPolicy={"path": "/ckpt/run/", "intervalSteps": 50})
    pod = workload.trainer_pod(job, 1, "node-x")
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "tiny-llama-node-1" and meta["namespace"] == "team-a"
    assert meta["labels"] == {"tessera.dev/job": "tiny-llama", "tessera.dev/role": "trainer"}
    assert workload.controlled_by(pod, job)
    (container,) = spec["containers"]
    assert container["image"] == "registry.example/trainer:7"
    assert container["command"] == ["python", "-m", "ntp.nodeagent"]
    # The agent's own options, then every rank's: the checkpoint the spec names, its args.
    assert container["args"] == [
        "--job", "tiny-llama", "--until-step", "100000", "--",
        "--save", "/ckpt/run/dense.pt", "--resume", "--save-every", "50", "--lr=0.01"]
    # what the node agent reads from them: the job, its steps in all, every rank's options
    assert AgentInvocation.from_args(container["args"]) == AgentInvocation(
        until_step=100_000, job="tiny-llama", trainer_args=(
            "--save", "/ckpt/run/dense.pt", "--resume", "--save-every", "50", "--lr=0.01"))
    # All the node's GPUs, as a limit and (requests being given) a request.
    assert container["resources"] == {
        "requests": {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "4"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": "4"}}
    env = {e["name"]: e for e in container["env"]}
    assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}
    # The downward API's node name wins over a spec entry of the same name.
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert [e["name"] for e in container["env"]].count("NODE_NAME") == 1
    assert spec["tolerations"] == [toleration] and spec["nodeSelector"] == {"pool": "a"}
    assert spec["serviceAccountName"] == "tiny-llama-trainer"
    assert spec["restartPolicy"] == "Never"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["node-x"]}]}]
    assert workload.placed_nodes([pod], job) == {1: "node-x"}
    # The spec is not changed by building pods from it.
    assert job["spec"]["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"},
                                        "limits": {"memory": "16Gi"}}


def test_the_rendezvous_pod_asks_for_no_gpu_and_keeps_the_jobs_scheduling_rules() -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    job = _job(tolerations=[toleration], nodeSelector={"pool": "a"})
    pod = workload.rendezvous_pod(job)
    (container,) = pod["spec"]["containers"]
    assert "resources" not in container and "affinity" not in pod["spec"]
    assert pod["spec"]["tolerations"] == [toleration]
    assert pod["spec"]["nodeSelector"] == {"pool": "a"}
    assert pod["spec"]["restartPolicy"] == "Always"
    assert workload.placed_nodes([pod], job) == {}


def test_the_trainer_identity_reads_its_layout_and_patches_its_progress_only() -> None:
    account, role, binding = workload.identity(_job())
    assert account["kind"] == "ServiceAccount" and account["metadata"]["name"] == \
        "tiny-llama-trainer"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["tiny-llama-layout"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["configmaps"],
         "resourceNames": ["tiny-llama-progress"], "verbs": ["get", "patch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-llama-trainer",
                                    "namespace": "team-a"}]


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
    views = workload.node_views(nodes, pods, {}, DOMAIN)
    assert {v.name: v.free_gpus for v in views} == {"a": 6, "b": 8, "c": 8, "d": 8}
    spec = JobSpec.from_spec(_job(gpusPerNode=8, totalGPUs=16)["spec"])
    assert workload.place(spec, 2, views) == ("b", "c")
    selected = workload.node_views(nodes, pods, {"pool": "other"}, DOMAIN)
    problem = workload.place(spec, 2, selected)
    assert isinstance(problem, Problem) and problem.reason == "Unschedulable"
    assert "found 1 such nodes of 1" in problem.message


def test_placement_keeps_tp_groups_inside_a_domain() -> None:
    # TP 8 over nodes of 4 GPUs: a group takes two nodes of one domain. Domain x has three
    # nodes (one group, one node left over), y has two: two groups, from y and x.
    nodes = [_node(f"x{i}", 4, "x") for i in range(3)] + [_node(f"y{i}", 4, "y")
                                                         for i in range(2)]
    spec = JobSpec.from_spec(_job(tensorParallelSize=8, dataParallelReplicas=2, gpusPerNode=4,
                                  totalGPUs=16, model=EXAMPLE["spec"]["model"] | {
                                      "heads": 8, "kvHeads": 2})["spec"])
    views = workload.node_views(nodes, [], {}, DOMAIN)
    assert workload.place(spec, 4, views) == ("x0", "x1", "y0", "y1")
    # Without the domain label every node is its own domain: no group fits.
    alone = workload.node_views([_node(f"n{i}", 4) for i in range(4)], [], {}, DOMAIN)
    problem = workload.place(spec, 4, alone)
    assert isinstance(problem, Problem) and "in 4 domains" in problem.message


def test_a_trainer_pod_being_deleted_marks_its_node_as_leaving() -> None:
    job = _job()
    going = workload.trainer_pod(job, 0, "node-a")
    going["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
    staying = workload.trainer_pod(job, 1, "node-b")
    rendezvous = workload.rendezvous_pod(job) | {"spec": {"nodeName": "node-c"}}
    rendezvous["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
    other = workload.trainer_pod(_job() | {"metadata": job["metadata"] | {"uid": "uid-2"}}, 2,
                                 "node-d")
    other["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
    assert workload.leaving_nodes([going, staying, rendezvous, other], job) == {"node-a"}
