"""The Helm chart (charts/tessera) and the kustomize bundle (manifests/) install the same objects
from the same files; the chart installs, upgrades and uninstalls on a local cluster, an
uninstall with a job running leaving nothing stuck."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from installharness import (
    CHART,
    HANG_S,
    ROOT,
    create_job,
    helm_binary,
    local_cluster,
    new_namespace,
    ready,
    run,
    tiny_job,
    wait_installed,
)
from kubernetes import client

from tessera_contracts.api import GROUP, JOB_LABEL, JOB_PLURAL
from tessera_dev import probes
from tessera_dev.controlplane import launcher

pytestmark = pytest.mark.ship

NAMESPACE = "tessera-system"
LOCAL_VALUES = CHART / "values-local.yaml"
# What Helm adds for its own bookkeeping, and nothing else may differ: these labels on every
# object, `helm.sh/resource-policy: keep` on the CRDs, and the uninstall hook's objects.
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance")
HELM_ANNOTATIONS = ("helm.sh/resource-policy",)
TESSERA_CRDS = ("ntptrainingjobs.tessera.dev", "gpupowertargets.tessera.dev",
                "gpuhealths.tessera.dev")


def objects(rendered: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Rendered objects by (kind, namespace, name), less Helm's bookkeeping and hooks."""
    out = {}
    for obj in yaml.safe_load_all(rendered):
        if not obj:
            continue
        meta = obj["metadata"]
        if "helm.sh/hook" in (meta.get("annotations") or {}):
            continue
        for field, helms in (("labels", HELM_LABELS), ("annotations", HELM_ANNOTATIONS)):
            kept = {k: v for k, v in (meta.pop(field, None) or {}).items() if k not in helms}
            if kept:
                meta[field] = kept
        key = (obj["kind"], meta.get("namespace", ""), meta["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = obj
    return out


def kustomize(path: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    return objects(run(["kubectl", "kustomize", str(path)]).stdout)


def helm_template(*argv: str, chart: Path = CHART) -> str:
    return run([str(helm_binary()), "template", "tessera", str(chart), "-n", NAMESPACE,
                *argv]).stdout


def assert_same(chart: dict, bundle: dict) -> None:
    assert chart.keys() == bundle.keys(), (
        f"only the chart: {sorted(chart.keys() - bundle.keys())}; "
        f"only the bundle: {sorted(bundle.keys() - chart.keys())}")
    for key in bundle:
        assert chart[key] == bundle[key], key


def test_every_kustomization_under_manifests_builds():
    found = sorted(p.parent for p in (ROOT / "manifests").rglob("kustomization.yaml"))
    assert {"install", "local", "monitoring", "crds"} <= {d.name for d in found}
    for directory in found:
        run(["kubectl", "kustomize", str(directory)])


def test_every_installed_object_has_the_recommended_labels():
    for key, obj in kustomize(ROOT / "manifests/install").items():
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/part-of") == "tessera", key
        for name in ("name", "component", "version"):
            assert labels.get(f"app.kubernetes.io/{name}"), (key, name)


def test_the_chart_lints():
    run([str(helm_binary()), "lint", str(CHART)])
    run([str(helm_binary()), "lint", str(CHART), "-f", str(LOCAL_VALUES)])


def test_default_values_render_what_kustomize_builds():
    rendered = helm_template()
    assert_same(objects(rendered), kustomize(ROOT / "manifests/install"))
    # only the hook's objects are extra, and Helm's labels are on every object
    for obj in yaml.safe_load_all(rendered):
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_local_values_render_what_the_local_overlay_builds():
    assert_same(objects(helm_template("-f", str(LOCAL_VALUES))),
                kustomize(ROOT / "manifests/local"))


def test_monitoring_renders_manifests_monitoring_with_the_selector_labels_given():
    chart = objects(helm_template("--set", "monitoring.enabled=true",
                                  "--set", "monitoring.labels.release=prom"))
    bundle = kustomize(ROOT / "manifests/install") | kustomize(ROOT / "manifests/monitoring")
    for key, obj in chart.items():
        if key[0] in ("PodMonitor", "PrometheusRule"):
            assert obj["metadata"]["labels"].pop("release") == "prom", key
            bundle[key]["metadata"]["labels"].pop("release", None)
    assert_same(chart, bundle)


def test_the_packaged_chart_carries_the_manifests(tmp_path):
    """`helm package` follows the chart's links into manifests/: the archive renders alone."""
    run([str(helm_binary()), "package", str(CHART), "-d", str(tmp_path)])
    (archive,) = tmp_path.glob("tessera-*.tgz")
    assert_same(objects(helm_template(chart=archive)), kustomize(ROOT / "manifests/install"))


def test_values_reach_the_objects():
    rendered = objects(helm_template(
        "-n", "ml-platform", "--set", "image.registry=registry.example/ml",
        "--set", "image.tag=0.2.0", "--set", "powerAgent.backend=sim",
        "--set", "powerAgent.resources.health.limits.memory=128Mi",
        "--set", "podSecurity.warn=baseline"))
    operator = rendered[("Deployment", "ml-platform", "tessera-operator")]
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/ml/tessera:0.2.0"
    agent, health = rendered[("DaemonSet", "ml-platform", "tessera-power-agent")][
        "spec"]["template"]["spec"]["containers"]
    assert agent["image"] == health["image"] == "registry.example/ml/tessera-power-agent:0.2.0"
    assert agent["args"][0] == "--backend=sim"
    assert health["resources"] == {"limits": {"memory": "128Mi"}}
    labels = rendered[("Namespace", "", "ml-platform")]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "baseline"
    assert labels["tessera.dev/install"] == "true"
    binding = rendered[("ClusterRoleBinding", "", "tessera-operator")]
    assert binding["subjects"][0]["namespace"] == "ml-platform"


def test_a_shared_namespace_is_refused_in_one_line():
    done = run([str(helm_binary()), "template", "tessera", str(CHART), "-n", "default"],
               check=False)
    assert done.returncode != 0
    assert "Tessera installs into a namespace of its own" in done.stderr


@pytest.fixture(scope="module")
def plane() -> Iterator[launcher.ControlPlane]:
    helm_binary()
    with local_cluster() as (plane, _):
        yield plane


def helm(plane: launcher.ControlPlane, *argv: str, check: bool = True):
    return run([str(helm_binary()), "-n", NAMESPACE, *argv], plane.kubeconfig, check=check,
               timeout=HANG_S + 60)


def test_install_brings_the_operator_and_an_agent_per_node_to_ready(plane):
    helm(plane, "install", "tessera", str(CHART), "-f", str(LOCAL_VALUES), "--wait",
         "--timeout", "5m")
    with plane.api_client() as api:
        wait_installed(api, NAMESPACE)


def test_upgrade_with_a_changed_value_rolls_the_operator(plane):
    with plane.api_client() as api:
        before = {p.metadata.uid for p in wait_installed(api, NAMESPACE)}
        helm(plane, "upgrade", "tessera", str(CHART), "-f", str(LOCAL_VALUES),
             "--set", "operator.resources.requests.cpu=50m",
             "--set", "operator.resources.requests.memory=200Mi", "--wait", "--timeout", "5m")
        operators = [p for p in wait_installed(api, NAMESPACE)
                     if p.metadata.labels["app.kubernetes.io/name"] == "tessera-operator"]
        for pod in operators:
            assert pod.metadata.uid not in before and ready(pod)
            assert pod.spec.containers[0].resources.requests == {"cpu": "50m",
                                                                 "memory": "200Mi"}


def test_uninstall_with_a_job_running_leaves_nothing_stuck(plane):
    with plane.api_client() as api:
        wait_installed(api, NAMESPACE)
        namespace = f"j-{uuid.uuid4().hex[:8]}"
        new_namespace(api, namespace)
        create_job(api, namespace, tiny_job("tiny"))
        core = client.CoreV1Api(api)
        probes.poll_until(
            lambda: core.list_namespaced_pod(namespace, label_selector=f"{JOB_LABEL}=tiny"
                                             ).items,
            lambda pods: any(p.status.phase == "Running" for p in pods), timeout=HANG_S,
            error=lambda last: AssertionError(f"the job's pods never ran: {last}"))

        done = helm(plane, "uninstall", "tessera", "--wait", "--timeout", "5m", check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        custom = client.CustomObjectsApi(api)
        assert custom.list_cluster_custom_object(GROUP, "v1alpha1", JOB_PLURAL)["items"] == []
        assert core.list_namespaced_pod(namespace).items == []

        def namespace_left() -> list[str]:
            return [n.metadata.name for n in core.list_namespace().items
                    if n.metadata.name == NAMESPACE]

        probes.poll_until(namespace_left, lambda left: not left, timeout=HANG_S,
                          error=lambda _: AssertionError(f"{NAMESPACE} still terminating"))
        admission = client.AdmissionregistrationV1Api(api)
        assert not [p.metadata.name for p in admission.list_validating_admission_policy().items
                    if p.metadata.name.startswith("tessera-")]
        assert not [b.metadata.name for b in
                    admission.list_validating_admission_policy_binding().items
                    if b.metadata.name.startswith("tessera-")]
        assert not client.RbacAuthorizationV1Api(api).list_cluster_role(
            label_selector="app.kubernetes.io/part-of=tessera").items
        # the policies' bindings are gone with their param: ConfigMaps are written as before
        core.create_namespaced_config_map(namespace, {"metadata": {"name": "after-uninstall"}})

        # the CRDs are kept (crds.keep) and, with no object left on a finalizer, deletable
        run(["kubectl", "delete", "crd", *TESSERA_CRDS, "--wait", "--timeout=120s"],
            plane.kubeconfig)
