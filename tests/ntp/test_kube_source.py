"""The node agent's Kubernetes source against a real kube-apiserver: a trainer pod's identity,
limited by a Role to its job's layout ConfigMap, follows each generation through a watch, is
refused every other ConfigMap, and skips malformed documents; it writes its node's progress
report as one key of the job's progress ConfigMap; an agent with that identity starts its rank
from the ConfigMap, reports its progress, and the rank dies with it."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator

import pytest
import test_node_agent as node_agent
import yaml
from kubernetes import client
from kubernetes import utils as kube_utils

from ntp.model import FLAVORS
from ntp.nodeagent.kube_source import (
    LAYOUT_KEY,
    KubeGenerationSource,
    layout_configmap,
    progress_writer,
)
from tessera_contracts.generation import Generation, Gpu, Rendezvous, next_generation
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.progress import (
    NodeReport,
    State,
    progress_configmap,
    read_reports,
    report_key,
)
from tessera_dev import paths, probes
from tessera_dev.controlplane import kubeconfig
from tessera_dev.simnode.faults import holders
from tessera_operator import workload

pytestmark = pytest.mark.foundation

JOB = "llm"
ACCOUNT = workload.identity_name(JOB)
GPUS = tuple(Gpu("gpu-node-0", i) for i in range(4))
rendezvous = node_agent.rendezvous  # the fixture: the job's store in a process of its own
# What "at once" means for a watch: the API server sends the event as it commits the write;
# the bound is the behaviour the agent needs (a mounted ConfigMap takes up to a minute).
SEEN_WITHIN_S = 1.0


def generation(n: int) -> Generation:
    """Generation n of a one-replica job (each one after the first keeps every process)."""
    gen = Generation(1, FLAVORS["debug"].shape(), 16, "NTP", (GPUS,), Rendezvous("10.0.0.5", 29500))
    for _ in range(n - 1):
        gen = next_generation(gen, gen.replicas)
    return gen


def publish(core: client.CoreV1Api, namespace: str, text: str) -> None:
    """Write the layout ConfigMap's document (create, then replace whole)."""
    body = {"metadata": {"name": layout_configmap(JOB)}, "data": {LAYOUT_KEY: text}}
    try:
        core.create_namespaced_config_map(namespace, body)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        core.replace_namespaced_config_map(layout_configmap(JOB), namespace, body)


@pytest.fixture
def trainer_api(control_plane, admin_api, namespace) -> Iterator[client.ApiClient]:
    """The trainer pod's identity as the operator makes it (`workload.identity`: get/list/watch
    on its job's layout ConfigMap, get/patch on its progress ConfigMap, nothing else)."""
    example = yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-local.yaml")
                             .read_text())
    job = {"apiVersion": "tessera.dev/v1alpha1", "kind": "NTPTrainingJob",
           "metadata": {"name": JOB, "namespace": namespace, "uid": "no-job"},
           "spec": example["spec"]}
    for obj in workload.identity(job, NTPTrainingJobSpec.from_spec(job["spec"])):
        # No job object exists here: an owner reference to it would have the garbage
        # collector remove the identity.
        del obj["metadata"]["ownerReferences"]
        kube_utils.create_from_dict(admin_api, obj, namespace=namespace)
    with control_plane.service_account_client(namespace, ACCOUNT) as api:
        core = client.CoreV1Api(api)
        selector = f"metadata.name={layout_configmap(JOB)}"

        def allowed() -> bool:
            try:
                core.list_namespaced_config_map(namespace, field_selector=selector)
            except client.ApiException as exc:
                if exc.status != 403:
                    raise
                return False
            return True

        # the authorizer sees the binding through its informers, a moment after it is made
        probes.poll_until(allowed, timeout=30,
                          error=lambda _: AssertionError("the Role binding never took effect"))
        yield api


def wait_logged(caplog: pytest.LogCaptureFixture, text: str, count: int = 1) -> None:
    probes.poll_until(lambda: sum(text in r.getMessage() for r in caplog.records) >= count,
                      timeout=30, error=lambda _: AssertionError(f"never logged {text!r}"))


def test_the_watch_sees_each_generation_and_skips_malformed_ones(
    trainer_api, admin_api, namespace, caplog
):
    caplog.set_level(logging.DEBUG, logger="ntp.nodeagent.kube_source")
    caplog.set_level(logging.DEBUG, logger="tessera_kube.listwatch")
    admin = client.CoreV1Api(admin_api)
    # The server ends each watch after a second, so the source watches again many times here.
    source = KubeGenerationSource(trainer_api, namespace, JOB, watch_s=1).start()
    try:
        # 1. Each generation the operator writes reaches the agent through the watch, the
        #    second one after the server ended a watch and the source resumed from where the
        #    first left off.
        for n in (1, 2):
            if n == 2:
                wait_logged(caplog, "watching again")
            published = time.monotonic()
            publish(admin, namespace, json.dumps(generation(n).to_dict()))
            assert source.wait_newer(n - 1, SEEN_WITHIN_S) == n, f"generation {n} not seen"
            print(f"generation {n} seen {time.monotonic() - published:.3f} s after the write")
            assert source.get(n) == generation(n).to_dict()
        # 2. A document that is not JSON, or breaks the contract, is logged and skipped: the
        #    agent keeps generation 2 and takes the next valid one.
        publish(admin, namespace, "{not json")
        wait_logged(caplog, "not JSON")
        broken = generation(3).to_dict() | {"mode": "FAST"}
        publish(admin, namespace, json.dumps(broken))
        wait_logged(caplog, "mode: must be one of")
        assert source.latest() == 2 and source.get(3) is None
        publish(admin, namespace, json.dumps(generation(3).to_dict()))
        assert source.wait_newer(2, SEEN_WITHIN_S) == 3
        assert source.get(3) == generation(3).to_dict()
    finally:
        source.stop()


def test_the_trainer_identity_is_refused_other_configmaps(trainer_api, admin_api, namespace):
    admin = client.CoreV1Api(admin_api)
    admin.create_namespaced_config_map(namespace, {"metadata": {"name": "other"},
                                                   "data": {"secret": "x"}})
    core = client.CoreV1Api(trainer_api)
    for call in (lambda: core.read_namespaced_config_map("other", namespace),
                 lambda: core.list_namespaced_config_map(namespace),
                 lambda: core.list_namespaced_config_map(
                     namespace, field_selector="metadata.name=other")):
        with pytest.raises(client.ApiException) as err:
            call()
        assert err.value.status == 403


def report(node: str, step: int) -> NodeReport:
    return NodeReport(node, 1, step, 100, State.TRAINING, productive_seconds=1.0,
                      wall_seconds=2.0, goodput=0.5, badput_seconds={"startup": 1.0})


def test_each_node_writes_its_own_key_of_the_progress_configmap(trainer_api, admin_api,
                                                                 namespace):
    admin = client.CoreV1Api(admin_api)
    write = progress_writer(trainer_api, namespace, JOB)
    # Before the operator has created the ConfigMap, a write fails (the agent logs it and
    # retries with its next report): the trainer's identity cannot create one.
    with pytest.raises(client.ApiException) as err:
        write(report("gpu-node-0", 1))
    assert err.value.status == 404
    admin.create_namespaced_config_map(namespace, {"metadata": {"name": progress_configmap(JOB)}})
    nodes = ("gpu-node-0", "gpu-node-1")
    write(report(nodes[0], 1))
    write(report(nodes[1], 2))
    write(report(nodes[0], 3))  # replaces its own key, keeps the other node's
    data = admin.read_namespaced_config_map(progress_configmap(JOB), namespace).data
    assert set(data) == {report_key(n) for n in nodes}
    assert read_reports(data, nodes) == {nodes[0]: report(nodes[0], 3),
                                         nodes[1]: report(nodes[1], 2)}
    # ... and no other ConfigMap
    with pytest.raises(client.ApiException) as err:
        progress_writer(trainer_api, namespace, "other-job")(report(nodes[0], 1))
    assert err.value.status == 403


def test_an_unreachable_api_is_logged_and_retried(caplog):
    caplog.set_level(logging.INFO, logger="ntp.nodeagent.kube_source")
    config = client.Configuration()
    config.host = "https://127.0.0.1:1"  # nothing listens on port 1
    with client.ApiClient(config) as api:
        source = KubeGenerationSource(api, "default", JOB, retry_s=(0.05, 0.1)).start()
        try:
            wait_logged(caplog, "API unreachable", count=2)  # once per try, and it tries again
            assert source.latest() is None
        finally:
            source.stop()


def test_an_agent_trains_from_the_configmap_and_its_ranks_die_with_it(
    control_plane, trainer_api, admin_api, namespace, rendezvous, tmp_path
):
    # The pod's agent as the pod runs it, with the trainer identity's token: the job's first
    # generation reaches it through the watch, and it starts the rank on its one GPU.
    token = control_plane.service_account_token(namespace, ACCOUNT)
    user = f"system:serviceaccount:{namespace}:{ACCOUNT}"
    config = kubeconfig.write(tmp_path / "kubeconfig", control_plane.token_kubeconfig(token, user))
    devices = tmp_path / "dev"
    devices.mkdir()
    (devices / "nvidia0").touch()
    log = tmp_path / "agent.log"
    agent = node_agent.spawn(
        [sys.executable, "-m", "ntp.nodeagent", "--node", "gpu-node-0", "--until-step", "100000",
         "--job", JOB, "--namespace", namespace, "--work-dir", str(tmp_path / "work"),
         "--metrics-port", "0"],
        log,
        {"KUBECONFIG": str(config), "TESSERA_SIM_DEVICES": str(devices),
         "NVIDIA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "1"},
    )
    gpu = Gpu("gpu-node-0", 0)
    first = Generation(1, FLAVORS["debug"].shape(), 4, "NTP", ((gpu,),),
                       Rendezvous("127.0.0.1", rendezvous))
    admin = client.CoreV1Api(admin_api)
    admin.create_namespaced_config_map(namespace, {"metadata": {"name": progress_configmap(JOB)}})
    publish(admin, namespace, json.dumps(first.to_dict()))
    probes.poll_until(lambda: node_agent.last_step(log), lambda step: step >= 1,
                      timeout=node_agent.PHASE_S,
                      error=lambda _: AssertionError(log.read_text()[-3000:]))
    [rank] = holders(devices / "nvidia0")
    assert f"rank 0 of generation 1 on {gpu}: pid {rank}" in log.read_text()
    # Its first step changes its state, so its report is written at once.
    progress = probes.poll_until(
        lambda: read_reports(admin.read_namespaced_config_map(
            progress_configmap(JOB), namespace).data, [gpu.node])[gpu.node],
        lambda r: r is not None and r.state is State.TRAINING, timeout=30,
        error=lambda r: AssertionError(f"report {r}; {log.read_text()[-3000:]}"))
    assert (progress.generation, progress.steps) == (1, 100000) and progress.step >= 1
    # The pod is killed: its rank goes with it (PR_SET_PDEATHSIG), releasing the GPU.
    agent.kill()
    agent.wait()
    probes.poll_until(lambda: holders(devices / "nvidia0"), lambda held: not held,
                      timeout=node_agent.PHASE_S,
                      error=lambda held: AssertionError(f"{held} outlived the agent"))
