"""NTPTrainingJobs queued in Kueue, with the real Kueue and Tessera's operator on the shared local
cluster: a ClusterQueue whose quota holds one job admits the first (its Workload counting the
job's GPUs) and holds the second suspended, saying it waits for Kueue, until the first completes;
a higher-priority job preempts a running one, which suspends, gives its quota back, and once
admitted again resumes from its checkpoint with the losses of an uninterrupted run; no trainer
pod is gated by Kueue's pod integration, on in the jobs' namespace; the operator's identity
writes only Workloads a job controls.

The jobs are tiny (TP2 on one node of 2 GPUs, a few steps). The times from Kueue's admission to
the first step and from the preemption to the job suspended are printed (`-s`); the Workload's
conditions carry seconds only, so each is good to a second.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kueueharness import GPUS, KUEUE_API, conditions, make_namespace, queues

from tessera_contracts.api import (
    ATTEMPT_LABEL,
    GROUP,
    JOB_LABEL,
    JOB_PLURAL,
    ROLE_LABEL,
    VERSION,
)
from tessera_contracts.generation import Gpu
from tessera_dev import demo_data, paths, probes
from tessera_dev.controlplane import cluster
from tessera_dev.reference import failure_free_losses

pytestmark = [pytest.mark.kueue, pytest.mark.timeout(2400)]

HANG_S = 300.0  # a guard against a hang, not a bound on how fast anything reacts
QUEUE_LABEL, PRIORITY_LABEL = "kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class"
LOSS_TOLERANCE = 1e-4  # the bound the job API's tests hold a resumed job's losses to
UNFINISHABLE = 100_000
EXAMPLE = yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-local.yaml").read_text())


class Flow:
    """A namespace Kueue manages, with queues whose quota holds `GPUS` GPUs (one job)."""

    def __init__(self, api: client.ApiClient, running: cluster.Cluster) -> None:
        self.api, self.cluster = api, running
        self.namespace = make_namespace(api, managed=True)
        self.queue = queues(api, self.namespace, gpus=GPUS)
        self.custom, self.core = client.CustomObjectsApi(api), client.CoreV1Api(api)

    def job(self, name: str, steps: int, priority: str | None = None) -> dict[str, Any]:
        """A tiny job on synthetic sequences, TP2 on one node, checkpointing every 5 steps on a
        claim of its own; created."""
        claim = self.cluster.shared_volume(self.api, name, self.namespace, size="1Gi")
        job = demo_data.without_dataset(copy.deepcopy(EXAMPLE))
        labels = {QUEUE_LABEL: self.queue} | ({PRIORITY_LABEL: priority} if priority else {})
        job["metadata"] = {"name": name, "labels": labels}
        spec = job["spec"]
        spec |= {"tensorParallelSize": GPUS, "dataParallelReplicas": 1, "gpusPerNode": GPUS,
                 "totalGPUs": GPUS, "steps": steps,
                 "checkpointPolicy": {"path": "/checkpoints/run", "intervalSteps": 5}}
        spec["failurePolicy"]["minTensorParallelSize"] = 1
        spec["powerPolicy"]["rackBudgetWatts"] = GPUS * spec["powerPolicy"]["baseCapWatts"] + 200
        pod = spec["template"]["spec"]
        pod["terminationGracePeriodSeconds"] = 5
        pod.setdefault("volumes", []).append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
        pod["containers"][0].setdefault("volumeMounts", []).append(
            {"name": "checkpoints", "mountPath": "/checkpoints"})
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, JOB_PLURAL,
                                                    job)
        return job

    def wait(self, what: str, probe: Any, done: Any = bool) -> Any:
        return probes.poll_until(probe, done, timeout=HANG_S, interval=0.5, error=lambda last: (
            AssertionError(f"{what} not reached in {HANG_S:.0f} s; last: {last!r}")))

    def status(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, JOB_PLURAL, name).get("status") or {}

    def workload(self, name: str) -> dict[str, Any]:
        try:
            return self.custom.get_namespaced_custom_object(
                *KUEUE_API, self.namespace, "workloads", f"{name}-workload")
        except client.ApiException as exc:
            if exc.status == 404:
                return {}
            raise

    def pods(self, name: str) -> list[client.V1Pod]:
        return self.core.list_namespaced_pod(self.namespace,
                                             label_selector=f"{JOB_LABEL}={name}").items

    def losses(self, name: str, attempt: int) -> dict[int, float]:
        """Step -> loss, as the ranks of the job's trainer pods of `attempt` logged them."""
        found: dict[int, float] = {}
        for pod in self.pods(name):
            labels = pod.metadata.labels
            if labels.get(ROLE_LABEL) != "trainer" or labels.get(ATTEMPT_LABEL) != str(attempt):
                continue
            for line in self.core.read_namespaced_pod_log(pod.metadata.name,
                                                          self.namespace).splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "loss" in record:
                    found.setdefault(record["step"], record["loss"])
        return found


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def _since(stamp: str) -> float:
    """Seconds from an RFC 3339 time the API server wrote to now."""
    return time.time() - datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _complete(flow: Flow, name: str) -> dict[str, Any]:
    return flow.wait(f"{name} Complete", lambda: flow.status(name),
                     lambda s: _condition(s, "Complete").get("status") == "True"
                     or _condition(s, "Failed").get("status") == "True")


def _not_gated(pods: list[client.V1Pod]) -> None:
    """No pod of the job taken by Kueue's pod integration as a workload of its own."""
    for pod in pods:
        gates = [g.name for g in pod.spec.scheduling_gates or []]
        assert not [g for g in gates if g.startswith("kueue.x-k8s.io/")], pod.metadata.name
        assert "kueue.x-k8s.io/managed" not in (pod.metadata.finalizers or [])
        assert "kueue.x-k8s.io/managed" not in (pod.metadata.labels or {})


def _admitted_after(flow: Flow, name: str) -> float:
    """Seconds from Kueue admitting the job's Workload to its first step seen."""
    admitted = flow.wait(f"{name}'s Workload admitted", lambda: flow.workload(name),
                         lambda w: conditions(w).get("Admitted", {}).get("status") == "True")
    flow.wait(f"{name}'s first step", lambda: flow.status(name).get("step", 0),
              lambda step: step >= 1)
    return _since(conditions(admitted)["Admitted"]["lastTransitionTime"])


def test_a_quota_of_one_job_admits_one_and_holds_the_next_until_it_completes(
        tessera_on_kueue: cluster.Cluster, kueue_api: client.ApiClient) -> None:
    flow = Flow(kueue_api, tessera_on_kueue)
    flow.job("first", steps=6)
    first_step_s = _admitted_after(flow, "first")
    flow.job("second", steps=6)

    # The second waits, suspended, and says so; Kueue counts the first job's GPUs.
    held = flow.wait("second waiting for Kueue's quota", lambda: flow.status("second"),
                     lambda s: "insufficient unused quota for nvidia.com/gpu" in
                     _condition(s, "Suspended").get("message", ""))
    assert held["phase"] == "Suspended"
    assert _condition(held, "Suspended")["reason"] == "WaitingForKueue"
    assert _condition(held, "Ready")["reason"] == "WaitingForKueue"
    assert flow.pods("second") == []
    (trainer, rendezvous) = flow.workload("first")["status"]["admission"]["podSetAssignments"]
    assert (trainer["name"], trainer["count"]) == ("trainer", 1)
    assert trainer["resourceUsage"]["nvidia.com/gpu"] == str(GPUS)
    assert "nvidia.com/gpu" not in rendezvous.get("resourceUsage", {})
    reserved = flow.custom.get_cluster_custom_object(
        *KUEUE_API, "clusterqueues", flow.queue)["status"]["flavorsReservation"]
    gpus = [r for flavor in reserved for r in flavor["resources"]
            if r["name"] == "nvidia.com/gpu"]
    assert [r["total"] for r in gpus] == [str(GPUS)]
    _not_gated(flow.pods("first"))

    # The first completes and its Workload is finished: the second is admitted and runs.
    assert _condition(_complete(flow, "first"), "Complete")["status"] == "True"
    finished = flow.wait("first's Workload Finished", lambda: flow.workload("first"),
                         lambda w: conditions(w).get("Finished", {}).get("status") == "True")
    assert conditions(finished)["Finished"]["reason"] == "Succeeded"
    _admitted_after(flow, "second")
    _not_gated(flow.pods("second"))
    assert _condition(_complete(flow, "second"), "Complete")["status"] == "True"
    print(f"\nKueue admission -> first step: {first_step_s:.1f} s")


def test_a_higher_priority_job_preempts_one_that_resumes_from_its_checkpoint(
        tessera_on_kueue: cluster.Cluster, kueue_api: client.ApiClient,
        tmp_path: Path) -> None:
    flow = Flow(kueue_api, tessera_on_kueue)
    low = flow.job("low", steps=UNFINISHABLE, priority="low")
    _admitted_after(flow, "low")
    flow.wait("low training past its second checkpoint",
              lambda: max(flow.losses("low", 0), default=0), lambda step: step >= 12)

    # The high-priority job preempts it: the low one suspends, its pods go, its quota is given
    # back (its Workload no longer admitted), and the high one runs.
    flow.job("high", steps=6, priority="high")
    evicted = flow.wait("low's Workload evicted", lambda: flow.workload("low"),
                        lambda w: conditions(w).get("Evicted", {}).get("status") == "True")
    assert conditions(evicted)["Evicted"]["reason"] == "Preempted"
    suspended = flow.wait("low suspended with no pod", lambda: (flow.status("low"),
                                                                flow.pods("low")),
                          lambda sp: sp[0].get("phase") == "Suspended" and not sp[1])[0]
    suspended_s = _since(conditions(evicted)["Evicted"]["lastTransitionTime"])
    assert _condition(suspended, "Suspended")["reason"] == "WaitingForKueue"
    assert suspended["attempt"] == 1 and suspended["restarts"] == 0
    _admitted_after(flow, "high")
    _not_gated(flow.pods("high"))

    # Set to finish a few steps past the checkpoint it resumes from, then admitted again
    # once the high one completes: attempt 1 from the newest checkpoint, the losses of a run
    # never preempted.
    files = flow.cluster.shared_path("low", flow.namespace) / "run"
    saved = max(int(d.name.removeprefix("step-")) for d in files.glob("step-*")
                if d.suffix != ".partial" and (d / "tessera.json").is_file())
    steps = saved + 6
    flow.custom.patch_namespaced_custom_object(GROUP, VERSION, flow.namespace, JOB_PLURAL,
                                               "low", {"spec": {"steps": steps}})
    reference = failure_free_losses(low["spec"] | {"steps": steps},
                                    (tuple(Gpu("gpu-node-0", i) for i in range(GPUS)),),
                                    tmp_path, timeout_s=HANG_S)
    assert _condition(_complete(flow, "high"), "Complete")["status"] == "True"
    _admitted_after(flow, "low")
    assert _condition(_complete(flow, "low"), "Complete")["status"] == "True"
    losses = flow.losses("low", 1)
    assert saved % 5 == 0 and saved >= 10, saved
    assert sorted(losses) == list(range(saved + 1, steps + 1))
    assert losses == pytest.approx({s: reference[s] for s in losses}, abs=LOSS_TOLERANCE)
    print(f"\nKueue preemption -> job suspended, its pods gone: {suspended_s:.1f} s")


def test_the_operator_writes_only_workloads_a_job_controls(
        tessera_on_kueue: cluster.Cluster, kueue_api: client.ApiClient) -> None:
    flow = Flow(kueue_api, tessera_on_kueue)
    operator = "system:serviceaccount:tessera-system:tessera-operator"
    env = os.environ | {"KUBECONFIG": str(tessera_on_kueue.plane.kubeconfig)}

    def kubectl(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["kubectl", "--as", operator, *argv], input=stdin, env=env,
                              capture_output=True, text=True, timeout=HANG_S)

    for verb, allowed in (("create", "yes"), ("patch", "yes"), ("delete", "no"),
                          ("update", "no")):
        said = kubectl("auth", "can-i", verb, "workloads.kueue.x-k8s.io", "-n", flow.namespace)
        assert said.stdout.strip() == allowed, (verb, said.stdout, said.stderr)
    stray = {"apiVersion": "/".join(KUEUE_API), "kind": "Workload",
             "metadata": {"name": "stray-workload", "namespace": flow.namespace},
             "spec": {"queueName": flow.queue, "podSets": [{"name": "main", "count": 1,
                                                            "template": {"spec": {"containers": [
                                                                {"name": "c", "image": "x"}]}}}]}}
    refused = kubectl("create", "-f", "-", stdin=json.dumps(stray))
    assert refused.returncode != 0
    assert "controlled by an NTPTrainingJob" in refused.stderr, refused.stderr
