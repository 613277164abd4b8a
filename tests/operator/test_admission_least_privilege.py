"""The shipped admission policies on a real kube-apiserver, as the identities they hold to less
than RBAC grants: the operator's token makes only pods of the shape it builds, and a trainer
pod's token, bound to its pod and so naming its node, writes only its own node's progress
report."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes import utils as kube_utils
from opharness import MANIFESTS, OPERATOR_SA, ROOT, SYSTEM_NS, apply_manifests

from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_contracts.progress import NodeReport, State, progress_configmap, report_key
from tessera_dev import probes, simnodes
from tessera_dev.controlplane import launcher
from tessera_operator import workload

pytestmark = pytest.mark.hardening

EXAMPLE = yaml.safe_load((ROOT / "manifests/examples/ntpjob-small.yaml").read_text())
ACCOUNTS_ANNOTATION = "tessera.dev/trainer-service-accounts"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
# The API server loads a policy through an informer, a moment after it is written.
IN_EFFECT_S = 30.0
# The garbage collector's graph sees a new pod within seconds; a guard against a hang.
COLLECTED_S = 60.0


@pytest.fixture(scope="module")
def policies(control_plane: launcher.ControlPlane, tessera_crds: list[str]) -> None:
    with control_plane.api_client() as admin:
        apply_manifests(admin, MANIFESTS)


@pytest.fixture
def operator_api(control_plane: launcher.ControlPlane, policies: None
                 ) -> Iterator[client.ApiClient]:
    with control_plane.service_account_client(SYSTEM_NS, OPERATOR_SA) as api:
        yield api


def _refusal(attempt: Callable[[], object]) -> client.ApiException | None:
    try:
        attempt()
    except client.ApiException as exc:
        return exc
    return None


def _forbidden(attempt: Callable[[], object]) -> str:
    """The message of the 403 the attempt gets; fails if it is let through or fails otherwise."""
    exc = _refusal(attempt)
    assert exc is not None, "allowed"
    assert exc.status == 403, exc.body
    return str(json.loads(exc.body)["message"])


def _in_effect(attempt: Callable[[], object], policy: str) -> None:
    """Wait until `attempt` is refused by `policy` (loaded by the API server)."""
    probes.poll_until(lambda: _refusal(attempt), lambda exc: exc is not None and exc.status == 403
                      and policy in str(exc.body), timeout=IN_EFFECT_S,
                      error=lambda exc: AssertionError(
                          f"{policy} never refused it: {exc.body if exc else 'allowed'}"))


def _job(admin: client.ApiClient, namespace: str, name: str, account: str | None = None
         ) -> dict[str, Any]:
    """The example job, its template naming `account` if given."""
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": name}
    if account:
        body["spec"]["template"]["spec"]["serviceAccountName"] = account
    return client.CustomObjectsApi(admin).create_namespaced_custom_object(
        "tessera.dev", "v1alpha1", namespace, "ntptrainingjobs", body)


def _spec(job: dict[str, Any]) -> NTPTrainingJobSpec:
    return NTPTrainingJobSpec.from_spec(job["spec"])


def _dry_run(api: client.ApiClient, pod: dict[str, Any]) -> object:
    return client.CoreV1Api(api).create_namespaced_pod(pod["metadata"]["namespace"], pod,
                                                       dry_run="All")


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"]["containers"]


def _privileged(pod: dict[str, Any]) -> None:
    _containers(pod)[0]["securityContext"] = {"privileged": True}


def _escalating(pod: dict[str, Any]) -> None:
    _containers(pod)[0]["securityContext"] = {"allowPrivilegeEscalation": True}


def _capable(pod: dict[str, Any]) -> None:
    _containers(pod)[0]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}


def _privileged_init(pod: dict[str, Any]) -> None:
    pod["spec"]["initContainers"] = [{"name": "setup", "image": "busybox",
                                      "securityContext": {"privileged": True}}]


def _host_root(pod: dict[str, Any]) -> None:
    pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    _containers(pod)[0]["volumeMounts"].append({"name": "host", "mountPath": "/host"})


def _host_port(pod: dict[str, Any]) -> None:
    _containers(pod)[0]["ports"][0]["hostPort"] = 9300


def _bound(pod: dict[str, Any]) -> None:
    pod["spec"]["nodeName"] = "any-node"


def _account(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda pod: pod["spec"].update(serviceAccountName=name)


def _owner(**fields: object) -> Callable[[dict[str, Any]], None]:
    return lambda pod: pod["metadata"]["ownerReferences"][0].update(fields)


def _label(key: str, value: str) -> Callable[[dict[str, Any]], None]:
    return lambda pod: pod["metadata"]["labels"].update({key: value})


def _renamed(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda pod: pod["metadata"].update(name=name)


# Each a trainer pod as the operator builds it, changed in one way; what the refusal names.
NOT_AS_BUILT: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "privileged": (_privileged, "no privileged container"),
    "allowPrivilegeEscalation": (_escalating, "no privileged container"),
    "an added capability": (_capable, "no privileged container"),
    "a privileged init container": (_privileged_init, "no privileged container"),
    "hostPath /": (_host_root, "no pod with host access"),
    "hostNetwork": (lambda pod: pod["spec"].update(hostNetwork=True), "no pod with host access"),
    "hostPID": (lambda pod: pod["spec"].update(hostPID=True), "no pod with host access"),
    "hostIPC": (lambda pod: pod["spec"].update(hostIPC=True), "no pod with host access"),
    "a hostPort": (_host_port, "no pod with host access"),
    "a nodeName": (_bound, "no pod with host access"),
    "another account": (_account("default"), "not default"),
    "no controller": (_owner(controller=False), "controlled by an NTPTrainingJob"),
    "another kind": (_owner(kind="Deployment", apiVersion="apps/v1"),
                     "controlled by an NTPTrainingJob"),
    "another job's label": (_label("tessera.dev/job", "other"), "labelled tessera.dev/job"),
    "a rendezvous role": (_label("tessera.dev/role", "rendezvous"), "its rendezvous"),
    "a name not the job's": (_renamed("shape-node-0x"), "trainer pods (<job>-node-<i>"),
}


def _with(pod: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    change(pod)
    return pod


def test_the_operator_creates_only_pods_of_the_shape_it_builds(
    operator_api: client.ApiClient, admin_api: client.ApiClient, namespace: str,
) -> None:
    """The issue's pod (privileged, hostPath /, a cluster-admin account, owned by a job that
    does not exist) is refused even as a dry run; each way out of the built shape is refused on
    its own; the trainer and rendezvous pods workload.py builds for the example job pass."""
    client.CoreV1Api(admin_api).create_namespaced_service_account(
        namespace, {"metadata": {"name": "root"}})  # say one bound to cluster-admin
    job = _job(admin_api, namespace, "shape")
    for obj in workload.identity(job, _spec(job)):
        kube_utils.create_from_dict(admin_api, obj, namespace=namespace)
    built = workload.trainer_pod(job, _spec(job), 0, "gpu-a")
    issue = copy.deepcopy(built)
    issue["metadata"]["ownerReferences"][0] |= {"name": "ghost", "uid": str(uuid.uuid4())}
    issue["metadata"]["name"] = workload.trainer_name("ghost", 0)
    issue["metadata"]["labels"]["tessera.dev/job"] = "ghost"
    _privileged(issue)
    _host_root(issue)
    _account("root")(issue)
    _in_effect(lambda: _dry_run(operator_api, issue), "tessera-operator-pods-as-built")

    for what, (change, named) in NOT_AS_BUILT.items():
        pod = _with(built, change)
        message = _forbidden(lambda pod=pod: _dry_run(operator_api, pod))
        assert named in message, (what, message)
    assert "shape-trainer" in _forbidden(
        lambda: _dry_run(operator_api, _with(built, _account("root")))), \
        "the refusal names the accounts it allows"

    for pod in (built, workload.trainer_pod(job, _spec(job), 1, "gpu-b"),
                workload.rendezvous_pod(job, _spec(job))):
        _dry_run(operator_api, pod)


def test_a_template_account_runs_where_the_namespace_lists_it(
    operator_api: client.ApiClient, admin_api: client.ApiClient, namespace: str,
) -> None:
    """The template may name its own service account; the operator's token runs pods under it
    only once the namespace lists it (the namespace's editors decide, not the job's author)."""
    core = client.CoreV1Api(admin_api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "llm-runner"}})
    job = _job(admin_api, namespace, "own-account", account="llm-runner")
    pods = (workload.trainer_pod(job, _spec(job), 0, "gpu-a"),
            workload.rendezvous_pod(job, _spec(job)))
    _in_effect(lambda: _dry_run(operator_api, pods[0]), "tessera-operator-pods-as-built")
    assert "not llm-runner" in _forbidden(lambda: _dry_run(operator_api, pods[1]))
    core.patch_namespace(namespace, {"metadata": {"annotations": {
        ACCOUNTS_ANNOTATION: "batch, llm-runner"}}})
    for pod in pods:
        probes.poll_until(lambda pod=pod: _refusal(lambda: _dry_run(operator_api, pod)),
                          lambda exc: exc is None, timeout=IN_EFFECT_S,
                          error=lambda exc: AssertionError(exc.body if exc else ""))


def test_a_pod_whose_job_does_not_exist_is_collected(
    operator_api: client.ApiClient, admin_api: client.ApiClient, namespace: str,
) -> None:
    """Admission cannot look the owner up; the garbage collector deletes a pod of the built
    shape whose job is not there."""
    job = _job(admin_api, namespace, "gone")
    client.CustomObjectsApi(admin_api).delete_namespaced_custom_object(
        "tessera.dev", "v1alpha1", namespace, "ntptrainingjobs", "gone")
    account = {"metadata": {"name": workload.identity_name("gone")}}
    client.CoreV1Api(admin_api).create_namespaced_service_account(namespace, account)
    pod = workload.trainer_pod(job, _spec(job), 0, "gpu-a")
    core = client.CoreV1Api(operator_api)
    core.create_namespaced_pod(namespace, pod)

    def present() -> bool:
        try:
            core.read_namespaced_pod(pod["metadata"]["name"], namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            return False
        return True

    probes.poll_until(present, lambda there: not there, timeout=COLLECTED_S, interval=0.5,
                      error=lambda _: AssertionError("the pod of a missing job was not collected"))


# ----------------------------------------------------------------------------------------------
# Progress reports
# ----------------------------------------------------------------------------------------------


def _report(node: str, step: int, state: State = State.TRAINING) -> str:
    return NodeReport(node, 1, step, max(step, 1000), state).to_json()


def _write(api: client.ApiClient, namespace: str, job: str, data: dict[str, str]) -> object:
    """As the node agent writes (`ntp.nodeagent.kube_source.progress_writer`)."""
    return client.CoreV1Api(api).patch_namespaced_config_map(
        progress_configmap(job), namespace, {"data": data},
        _content_type="application/strategic-merge-patch+json")


def _pod_token(admin: client.ApiClient, pod: dict[str, Any]) -> str:
    """The token the node gives the pod: a TokenRequest bound to it."""
    meta = pod["metadata"]
    spec = {"audiences": [launcher.SERVICE_ACCOUNT_ISSUER], "expirationSeconds": 3600,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "uid": meta["uid"]}}
    return client.CoreV1Api(admin).create_namespaced_service_account_token(
        pod["spec"]["serviceAccountName"], meta["namespace"], {"spec": spec}).status.token


def test_a_trainer_pod_writes_only_its_own_nodes_report(
    control_plane: launcher.ControlPlane, operator_api: client.ApiClient,
    admin_api: client.ApiClient, namespace: str,
) -> None:
    """The issue's forgery: the pod on node 0 writing node 1's report, or both as Finished, is
    refused by name, and so are deleting node 1's report (a null in a merge patch) and making the
    ConfigMap immutable (no node's report could be written for the rest of the attempt); its own
    report goes in; the operator still writes the ConfigMap whole; a token of the trainer
    identity bound to no pod writes nothing."""
    name = "forged"
    job = _job(admin_api, namespace, name)
    nodes = simnodes.register(admin_api, [f"prog-{uuid.uuid4().hex[:6]}-{i}" for i in (0, 1)],
                              name)
    for obj in workload.identity(job, _spec(job)):
        kube_utils.create_from_dict(admin_api, obj, namespace=namespace)
    core_admin = client.CoreV1Api(admin_api)
    pods = []
    for i, node in enumerate(nodes):
        pod = workload.trainer_pod(job, _spec(job), i, node)
        pod["spec"]["nodeName"] = node  # as the scheduler binds it; no kubelet runs it here
        pods.append(admin_api.sanitize_for_serialization(
            core_admin.create_namespaced_pod(namespace, pod)))
    # The operator makes the ConfigMap, and writes it whole.
    client.CoreV1Api(operator_api).create_namespaced_config_map(
        namespace, workload.progress_configmap(job))
    _write(operator_api, namespace, name, {report_key(n): _report(n, 0) for n in nodes})

    token = _pod_token(admin_api, pods[0])
    user = f"system:serviceaccount:{namespace}:{workload.identity_name(name)}"
    with config.new_client_from_config_dict(control_plane.token_kubeconfig(token, user)
                                            ) as pod_api:
        review = client.AuthenticationV1Api(pod_api).create_self_subject_review({})
        assert review.status.user_info.extra[NODE_NAME_EXTRA] == [nodes[0]]
        own, other = report_key(nodes[0]), report_key(nodes[1])
        forged = {other: _report(nodes[1], 999_999)}
        _in_effect(lambda: _write(pod_api, namespace, name, forged),
                   "tessera-progress-own-node-only")
        message = _forbidden(lambda: _write(pod_api, namespace, name, forged))
        assert f"node {nodes[0]} may write only its own report, key {own}" in message, message
        _forbidden(lambda: _write(pod_api, namespace, name, {
            n: _report(n, 1_000_000, State.FINISHED) for n in (own, other)}))
        _forbidden(lambda: client.CoreV1Api(pod_api).patch_namespaced_config_map(
            progress_configmap(name), namespace,
            {"metadata": {"labels": {"tessera.dev/attempt": "9"}}}))

        def merge(patch: dict[str, Any]) -> object:
            return client.CoreV1Api(pod_api).patch_namespaced_config_map(
                progress_configmap(name), namespace, patch,
                _content_type="application/merge-patch+json")

        deleted = _forbidden(lambda: merge({"data": {other: None}}))
        assert f"may write only its own report, key {own}" in deleted, deleted
        frozen = _forbidden(lambda: merge({"immutable": True, "data": {own: _report(nodes[0], 4)}}))
        assert "changes nothing of a job's progress ConfigMap but its own" in frozen, frozen
        _write(pod_api, namespace, name, {own: _report(nodes[0], 5)})
    progress = core_admin.read_namespaced_config_map(progress_configmap(name), namespace)
    assert progress.data == {own: _report(nodes[0], 5), other: _report(nodes[1], 0)}
    assert not progress.immutable

    with control_plane.service_account_client(namespace, workload.identity_name(name)) as unbound:
        assert "names no node" in _forbidden(
            lambda: _write(unbound, namespace, name, {own: _report(nodes[0], 6)}))

