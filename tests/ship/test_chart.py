"""The Helm chart (charts/tessera) and the kustomize bundle (manifests/) install the same objects
from the same files, into tessera-system or any other namespace; the chart installs into another
namespace, runs a job there, upgrades and uninstalls on a local cluster, an uninstall with a job
running leaving nothing stuck."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from installharness import (
    CHART,
    GPUS,
    HANG_S,
    NODES,
    ROOT,
    create_job,
    helm_binary,
    job_status,
    local_cluster,
    new_namespace,
    run,
    tiny_job,
)
from kubernetes import client

from tessera_agents.power.sim_backend import SimBackend
from tessera_cli import cordon
from tessera_contracts.api import GROUP, JOB_PLURAL, POWER_TARGET_PLURAL, VERSION
from tessera_dev import install, probes
from tessera_dev.controlplane import crds, launcher
from tessera_dev.simnode import faults
from tessera_operator import leader

pytestmark = pytest.mark.ship

NAMESPACE = "tessera-system"
# the live release's namespace: not the shipped one, so the admission policies are shown to
# follow the install wherever it is
OTHER = "tessera-elsewhere"
LOCAL_VALUES = CHART / "values-local.yaml"
# What Helm adds for its own bookkeeping, and nothing else may differ: these labels on every
# object, `helm.sh/resource-policy: keep` on the CRDs, and the uninstall hook's objects.
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance")
HELM_ANNOTATIONS = ("helm.sh/resource-policy",)
CLUSTER_SCOPED_POLICIES = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
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


def helm_template(*argv: str, chart: Path = CHART, namespace: str = NAMESPACE) -> str:
    return run([str(helm_binary()), "template", "tessera", str(chart), "-n", namespace,
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


def test_the_runbook_base_url_goes_in_front_of_every_alerts_runbook():
    base = "https://git.example.com/ml/tessera/blob/v0.1.0/"
    chart = objects(helm_template("--set", "monitoring.enabled=true",
                                  "--set", f"monitoring.runbookBaseURL={base}"))
    bundle = kustomize(ROOT / "manifests/monitoring")
    key = ("PrometheusRule", NAMESPACE, "tessera")
    shipped = [rule for group in bundle[key]["spec"]["groups"] for rule in group["rules"]]
    rendered = [rule for group in chart[key]["spec"]["groups"] for rule in group["rules"]]
    alerts = [(s["annotations"]["runbook_url"], r["annotations"]["runbook_url"])
              for s, r in zip(shipped, rendered, strict=True) if "alert" in s]
    assert alerts and all(url == base + path for path, url in alerts), alerts


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


# The grammar of an image reference, from the distribution project's reference/regexp.go (the
# parser container runtimes use): domain[:port]/path[:tag][@digest].
_ALNUM = r"[a-z0-9]+"
_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|[-]+){_ALNUM})*"
_DOMAIN = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"{_DOMAIN}(?:\.{_DOMAIN})*(?::[0-9]+)?"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*"
    r":[0-9a-fA-F]{32,})?")
DIGEST = "sha256:" + "0123456789abcdef" * 4


def pod_specs(rendered: str) -> dict[str, dict[str, Any]]:
    """The pod spec of every workload rendered, the uninstall hook's included, by kind/name."""
    return {f"{obj['kind']}/{obj['metadata']['name']}": obj["spec"]["template"]["spec"]
            for obj in yaml.safe_load_all(rendered)
            if obj and obj["kind"] in ("Deployment", "DaemonSet", "Job")}


@pytest.mark.parametrize(("value", "says"), [
    ("imagePullSecret[0]=regcred", "additional properties 'imagePullSecret' not allowed"),
    ("operator.imag.repository=mine", "at '/operator': additional properties 'imag' not "
                                      "allowed"),
    ("powerAgent.exporter.discover=pods", "additional properties 'discover' not allowed"),
    ("uninstall.timeoutSeconds=soon", "at '/uninstall/timeoutSeconds': got string, want "
                                      "integer"),
    ("crds.keep=maybe", "at '/crds/keep': got string, want boolean"),
    (f"image.tag={DIGEST}", "at '/image/tag'"),
    ("operator.image.digest=sha256:abc", "at '/operator/image/digest'"),
    ("powerAgent.exporter.discovery=dns", "at '/powerAgent/exporter/discovery'"),
], ids=["misspelt-top", "misspelt-nested", "misspelt-exporter", "string-for-integer",
        "string-for-boolean", "digest-as-tag", "short-digest", "unknown-discovery"])
def test_a_misspelt_value_or_a_wrong_type_is_refused_by_the_schema(value, says):
    done = run([str(helm_binary()), "template", "tessera", str(CHART), "-n", NAMESPACE,
                "--set", value], check=False)
    assert done.returncode != 0, f"{value} rendered"
    assert "values don't meet the specifications of the schema" in done.stderr, done.stderr
    assert says in done.stderr, done.stderr


def test_an_image_given_by_digest_renders_a_valid_reference_for_every_pod():
    rendered = helm_template("--set", "image.registry=registry.example:5000/ml",
                             "--set", f"operator.image.digest={DIGEST}",
                             "--set", f"powerAgent.image.digest={DIGEST}")
    images = {f"{where}/{c['name']}": c["image"] for where, pod in pod_specs(rendered).items()
              for c in pod["containers"]}
    assert set(images) == {"Deployment/tessera-operator/operator",
                           "DaemonSet/tessera-power-agent/agent",
                           "DaemonSet/tessera-power-agent/health",
                           "Job/tessera-uninstall/uninstall"}
    for where, image in images.items():
        assert IMAGE_REFERENCE.fullmatch(image), (where, image)
        repository = "tessera" if "operator" in where or "uninstall" in where else (
            "tessera-power-agent")
        assert image == f"registry.example:5000/ml/{repository}@{DIGEST}", (where, image)
    # by tag, the same grammar
    for image in (c["image"] for pod in pod_specs(helm_template()).values()
                  for c in pod["containers"]):
        assert IMAGE_REFERENCE.fullmatch(image) and image.endswith(":0.1.0"), image


@pytest.mark.parametrize("secrets", [
    ["--set", "imagePullSecrets={regcred,mirror}"],
    ["--set", "imagePullSecrets[0].name=regcred", "--set", "imagePullSecrets[1].name=mirror"],
], ids=["names", "objects"])
def test_pull_secrets_and_scheduling_values_reach_every_pod(secrets):
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["ml"]}]}]}}}
    values = {"operator": {"nodeSelector": {"pool": "system"}, "tolerations": [toleration],
                           "affinity": affinity, "priorityClassName": "platform-critical"},
              "powerAgent": {"nodeSelector": {"pool": "gpu"}, "tolerations": [toleration],
                             "priorityClassName": "gpu-agents"}}
    given = Path(tempfile.mkdtemp()) / "values.yaml"
    given.write_text(yaml.safe_dump(values))
    pods = pod_specs(helm_template(*secrets, "-f", str(given)))
    for where, pod in pods.items():
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}], where
    operator, agent = pods["Deployment/tessera-operator"], pods["DaemonSet/tessera-power-agent"]
    hook = pods["Job/tessera-uninstall"]
    for pod in (operator, hook):  # the hook runs the operator's image, where the operator may
        assert pod["nodeSelector"] == {"pool": "system"}
        assert pod["tolerations"] == [toleration]
        assert pod["affinity"] == affinity
        assert pod["priorityClassName"] == "platform-critical"
    assert agent["nodeSelector"] == {"pool": "gpu"} and agent["tolerations"] == [toleration]
    assert agent["priorityClassName"] == "gpu-agents"
    # not given: the manifest's own (the operator's replicas spread over nodes; the agent on
    # the GPU nodes, tolerating their taint, node-critical), and no pull secret
    shipped = pod_specs(helm_template())
    assert shipped["Deployment/tessera-operator"]["affinity"]["podAntiAffinity"]
    assert shipped["DaemonSet/tessera-power-agent"]["nodeSelector"] == {
        "nvidia.com/gpu.present": "true"}
    assert shipped["DaemonSet/tessera-power-agent"]["priorityClassName"] == (
        "system-node-critical")
    assert not [where for where, pod in shipped.items() if "imagePullSecrets" in pod]


def test_the_uninstall_hook_deletes_jobs_only_when_the_release_says_so():
    for value, flag, verbs in (("false", [], ["list"]), ("true", ["--delete-jobs"],
                                                         ["list", "delete"])):
        hook = [obj for obj in yaml.safe_load_all(helm_template(
            "--set", f"uninstall.deleteJobs={value}")) if obj and obj["metadata"]["name"] ==
            "tessera-uninstall"]
        (job,) = (obj for obj in hook if obj["kind"] == "Job")
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert container["args"] == ["uninstall", "--timeout=240",
                                     f"--namespace={NAMESPACE}", *flag], value
        (role,) = (obj for obj in hook if obj["kind"] == "ClusterRole")
        assert [r["verbs"] for r in role["rules"] if "ntptrainingjobs" in r["resources"]] == [
            verbs], value


def test_exporter_discovery_values_reach_the_health_agent_and_its_rbac():
    rendered = helm_template(
        "-n", "ml-platform", "--set", "powerAgent.exporter.namespace=dcgm",
        "--set", "powerAgent.exporter.service=dcgm-exporter",
        "--set", "powerAgent.exporter.port=metrics",
        "--set", "powerAgent.exporter.discovery=pods",
        "--set", "powerAgent.exporter.selector=app.kubernetes.io/name=dcgm-exporter")
    objs = objects(rendered)
    (health,) = (c for c in objs[("DaemonSet", "ml-platform", "tessera-power-agent")]["spec"][
        "template"]["spec"]["containers"] if c["name"] == "health")
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in health["args"])
    assert {k: v for k, v in flags.items() if k.startswith("exporter-")} == {
        "exporter-namespace": "dcgm", "exporter-service": "dcgm-exporter",
        "exporter-port": "metrics", "exporter-discovery": "pods",
        "exporter-selector": "app.kubernetes.io/name=dcgm-exporter"}
    assert len(health["args"]) == len(flags), "a flag given twice"
    # finding it among pods, the agent may list pods in the exporter's namespace, only there
    role = objs[("Role", "dcgm", "tessera-dcgm-exporter-pod-finder")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    binding = objs[("RoleBinding", "dcgm", "tessera-power-agent-dcgm-exporter-pod-finder")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tessera-power-agent",
                                    "namespace": "ml-platform"}]
    assert not [key for key in objs if key[0] == "Role" and key[1] == "gpu-operator"]
    # the local overlay's own Role follows the exporter's namespace too, once
    local = objects(helm_template("-f", str(LOCAL_VALUES),
                                  "--set", "powerAgent.exporter.namespace=dcgm",
                                  "--set", "powerAgent.exporter.discovery=pods"))
    assert [key for key in local if key[0] in ("Role", "RoleBinding")
            and "pod-finder" in key[2]] == [
        ("Role", "dcgm", "tessera-dcgm-exporter-pod-finder"),
        ("RoleBinding", "dcgm", "tessera-power-agent-dcgm-exporter-pod-finder")]
    # an exporter on the host's network: its URL, and the node's address to write it with
    url = objects(helm_template(
        "--set", "powerAgent.exporter.url=http://$(HOST_IP):9400/metrics"))
    (health,) = (c for c in url[("DaemonSet", NAMESPACE, "tessera-power-agent")]["spec"][
        "template"]["spec"]["containers"] if c["name"] == "health")
    assert "--exporter-url=http://$(HOST_IP):9400/metrics" in health["args"]
    assert {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}} in (
        health["env"])


def test_another_namespace_moves_only_the_shipped_namespaces_objects():
    """The local overlay's Role in the exporter's namespace stays there, bound to the agents in
    the release's namespace."""
    rendered = objects(helm_template("-n", "ml-platform", "-f", str(LOCAL_VALUES)))
    assert ("Role", "gpu-operator", "tessera-dcgm-exporter-pod-finder") in rendered
    binding = rendered[("RoleBinding", "gpu-operator",
                        "tessera-power-agent-dcgm-exporter-pod-finder")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tessera-power-agent",
                                    "namespace": "ml-platform"}]
    assert not [key for key in rendered if key[1] == NAMESPACE]


def test_another_namespace_renders_what_a_namespace_overlay_builds(tmp_path):
    """The kustomize way into another namespace: `namespace:` over manifests/local, with the
    exporter's Role and RoleBinding put back where the exporter runs (a `namespace:` overlay moves
    every object), is what the chart renders for that release namespace."""
    moved = tmp_path / "moved"
    moved.mkdir()
    base = os.path.relpath(ROOT / "manifests/local", moved)  # kustomize takes relative bases
    (moved / "kustomization.yaml").write_text(f"namespace: {OTHER}\nresources:\n  - {base}\n")
    back = {"op": "replace", "path": "/metadata/namespace", "value": "gpu-operator"}
    patches = [
        {"target": {"kind": "Role", "name": "tessera-dcgm-exporter-pod-finder"},
         "patch": yaml.safe_dump([back])},
        {"target": {"kind": "RoleBinding", "name": "tessera-power-agent-dcgm-exporter-pod-finder"},
         "patch": yaml.safe_dump([back, {"op": "replace", "path": "/subjects/0/namespace",
                                         "value": OTHER}])}]
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["moved"], "patches": patches}))
    bundle = {}
    for (kind, namespace, name), obj in kustomize(tmp_path).items():
        # kubectl's kustomize does not know these kinds are cluster-scoped and gives them the
        # overlay's namespace, which kubectl drops when it applies them
        if kind in CLUSTER_SCOPED_POLICIES:
            obj["metadata"].pop("namespace", None)
            namespace = ""
        bundle[kind, namespace, name] = obj
    assert_same(objects(helm_template("-f", str(LOCAL_VALUES), namespace=OTHER)), bundle)


def test_a_shared_namespace_is_refused_in_one_line():
    done = run([str(helm_binary()), "template", "tessera", str(CHART), "-n", "default"],
               check=False)
    assert done.returncode != 0
    assert "Tessera installs into a namespace of its own" in done.stderr


WIDGETS = """\
apiVersion: example.com/v1
kind: Widget
metadata: {name: w1, namespace: tessera-system, labels: {keep: "yes"}}
spec:
  items: [a, b]
  nested: {ports: [{name: http, port: 80}]}
---
apiVersion: example.com/v1
kind: Widget
metadata: {name: w2, namespace: tessera-system, labels: {keep: "yes"}}
spec: {items: [a, b]}
"""


def patched(ops: list[dict[str, Any]], **target: str) -> dict[str, Any]:
    return {"target": {"group": "example.com", "kind": "Widget", **target},
            "patch": yaml.safe_dump(ops)}


@pytest.fixture(scope="module")
def chart_copy(tmp_path_factory) -> Path:
    """The chart with its links followed, as `helm package` carries it, to add kustomizations to."""
    copy = tmp_path_factory.mktemp("chart") / "tessera"
    shutil.copytree(CHART, copy)
    return copy


def kustomization(chart: Path, name: str, content: dict[str, Any]) -> str:
    """A kustomization of the widgets in the chart's manifests/; the value that builds it."""
    directory = chart / "files" / "manifests" / name
    directory.mkdir()
    (directory / "widgets.yaml").write_text(WIDGETS)
    (directory / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["widgets.yaml"]} | content))
    return f"kustomization=manifests/{name}"


def test_json_patches_render_as_kustomize_applies_them(chart_copy):
    value = kustomization(chart_copy, "patched", {
        "labels": [{"pairs": {"app.kubernetes.io/part-of": "tessera"}}],
        "patches": [patched([
            {"op": "test", "path": "/spec/items/0", "value": "a"},
            {"op": "add", "path": "/spec/items/0", "value": "first"},
            {"op": "add", "path": "/spec/items/-", "value": "last"},
            {"op": "replace", "path": "/spec/items/2", "value": "B"},
            {"op": "add", "path": "/spec/items/4", "value": "end"},
            {"op": "add", "path": "/metadata/labels/example.com~1tier", "value": "gold"},
            {"op": "replace", "path": "/spec/nested/ports/0/port", "value": 8080},
            {"op": "test", "path": "/spec/nested/ports/0", "value": {"name": "http",
                                                                      "port": 8080}},
            {"op": "add", "path": "/spec/extra", "value": {"x": [1, {"y": None}]}},
        ], name="w1"), patched([{"op": "add", "path": "/spec/every", "value": True}])]})
    chart = objects(helm_template("--set", value, chart=chart_copy))
    assert_same(chart, kustomize(chart_copy / "files/manifests/patched"))
    w1 = chart[("Widget", NAMESPACE, "w1")]
    assert w1["spec"]["items"] == ["first", "a", "B", "last", "end"]
    assert chart[("Widget", NAMESPACE, "w2")]["spec"] == {"items": ["a", "b"], "every": True}


@pytest.mark.parametrize(("content", "message"), [
    ({"patches": [patched([{"op": "move", "from": "/spec/items/0", "path": "/spec/items/1"}])]},
     'the chart interprets the JSON 6902 operations test, replace and add, not "move"'),
    ({"patches": [patched([{"op": "test", "path": "/spec/items/0", "value": "z"}])]},
     'test /spec/items/0: "a", not "z"'),
    ({"patches": [patched([{"op": "replace", "path": "/spec/items/2", "value": "c"}])]},
     "replace /spec/items/2: no such location"),
    ({"patches": [patched([{"op": "add", "path": "/spec/items/0/x", "value": "c"}])]},
     "add /spec/items/0/x: no such location"),
    ({"patches": [{"target": {"kind": "Widget"}, "patch": "spec: {items: [c]}"}]},
     "the chart interprets only JSON 6902 patches"),
    ({"patches": [{"target": {"labelSelector": "keep=yes"}, "patch": "[]"}]},
     "only patches given inline with a target of group, kind and name"),
    ({"namePrefix": "x-"}, "the chart does not interpret namePrefix"),
    ({"labels": [{"pairs": {"a": "b"}, "includeSelectors": True}]},
     "the chart interprets only the pairs of labels, not includeSelectors"),
], ids=["move", "failed-test", "replace-past-the-end", "into-a-string", "strategic-merge",
        "label-selector", "name-prefix", "label-selectors"])
def test_what_the_chart_does_not_build_as_kustomize_fails_in_one_line(chart_copy, content,
                                                                      message):
    value = kustomization(chart_copy, f"bad-{uuid.uuid4().hex[:8]}", content)
    done = run([str(helm_binary()), "template", "tessera", str(chart_copy), "-n", NAMESPACE,
                "--set", value], check=False)
    assert done.returncode != 0
    # the whole reason on the error line (Helm adds its --debug hint below it)
    assert message in done.stderr.splitlines()[0], done.stderr


def readme_install() -> list[str]:
    """The chart README's command for the local cluster, its arguments after `helm`, into OTHER."""
    text = (CHART / "README.md").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines()
                if line.lstrip().startswith("helm install") and "values-local.yaml" in line)
    argv = shlex.split(line, comments=True)
    assert argv[:4] == ["helm", "install", "tessera", "charts/tessera"], argv
    flags = [str(ROOT / a) if a.startswith("charts/") else a for a in argv[4:]]
    flags[flags.index("-n") + 1] = OTHER
    return ["install", "tessera", str(CHART), *flags]


@pytest.fixture(scope="module")
def plane() -> Iterator[launcher.ControlPlane]:
    """A local cluster of its own with the CRDs as `tessera-dev up` leaves them, and the chart
    installed on it by the README's `helm install` for the local cluster, into OTHER, as a user
    installs it; each test starts from that release."""
    helm_binary()
    with local_cluster() as (plane, _):
        with plane.api_client() as api:
            crds.apply(api, crds.load())  # what `tessera-dev up` does before its nodes start
        started = time.monotonic()
        helm(plane, *readme_install(), "--wait", "--timeout", "5m")
        print(f"helm install --wait: {time.monotonic() - started:.0f} s")
        yield plane


def helm(plane: launcher.ControlPlane, *argv: str, check: bool = True):
    return run([str(helm_binary()), "-n", OTHER, *argv], plane.kubeconfig, check=check,
               timeout=HANG_S + 60)


def pods(api: client.ApiClient, name: str) -> list[client.V1Pod]:
    """The pods of app.kubernetes.io/name=`name` in the install's namespace, none terminating."""
    return [p for p in client.CoreV1Api(api).list_namespaced_pod(
        OTHER, label_selector=f"app.kubernetes.io/name={name}").items
        if p.metadata.deletion_timestamp is None]


def ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def test_install_brings_the_operator_and_an_agent_per_node_to_ready(plane):
    with plane.api_client() as api:
        install.wait(api, NODES, timeout=HANG_S, namespace=OTHER)
        namespaces = {n.metadata.name for n in client.CoreV1Api(api).list_namespace().items}
        assert install.SYSTEM_NS not in namespaces
        operators = pods(api, "tessera-operator")
        assert len(operators) == 2 and all(map(ready, operators))
        holder = probes.poll_until(
            lambda: client.CoordinationV1Api(api).read_namespaced_lease(
                leader.LEASE_NAME, OTHER).spec.holder_identity,
            lambda held: held in {p.metadata.name for p in operators}, timeout=HANG_S,
            error=lambda held: AssertionError(f"the Lease is held by {held}, not an operator"))
        assert holder
        agents = pods(api, "tessera-power-agent")
        assert sorted(p.spec.node_name for p in agents) == [f"gpu-node-{k}" for k in range(NODES)]
        for agent in agents:
            assert ready(agent)
            assert [c.name for c in agent.spec.containers] == ["agent", "health"]
            assert agent.spec.containers[0].args[0] == "--backend=sim"
            assert "--exporter-discovery=pods" in agent.spec.containers[1].args


def test_upgrade_with_a_changed_value_rolls_the_operator(plane):
    with plane.api_client() as api:
        before = {p.metadata.uid for p in pods(api, "tessera-operator")}
        helm(plane, "upgrade", "tessera", str(CHART), "-f", str(LOCAL_VALUES),
             "--set", "operator.resources.requests.cpu=50m",
             "--set", "operator.resources.requests.memory=200Mi", "--wait", "--timeout", "5m")
        install.wait(api, NODES, timeout=HANG_S, namespace=OTHER)
        operators = pods(api, "tessera-operator")
        assert len(operators) == 2
        for pod in operators:
            assert pod.metadata.uid not in before and ready(pod)
            assert pod.spec.containers[0].resources.requests == {"cpu": "50m",
                                                                 "memory": "200Mi"}


def limits_w(plane: launcher.ControlPlane, node: str) -> list[int]:
    """The power limits of the simulated node's GPUs, in watts, as the hardware holds them."""
    gpus = SimBackend(state_path=faults.node_dir(plane.data_dir, node) / faults.GPU_STATE)
    return [mw // 1000 for mw in gpus.limits_mw()]


@pytest.mark.hardening
def test_uninstall_with_a_job_training_leaves_nothing_stuck(plane):
    """The job's GPU 1 of gpu-node-1 cordoned, held at its 200 W minimum: `helm uninstall` with
    the job training fails, naming the job, which trains on; the job deleted by its owner as it
    trains, `helm uninstall` again leaves every GPU of the job's nodes at the 500 W base cap,
    nothing of Tessera in its namespace (its Lease included), and the kept CRDs deletable."""
    with plane.api_client() as api:
        install.wait(api, NODES, timeout=HANG_S, namespace=OTHER)
        namespace = f"j-{uuid.uuid4().hex[:8]}"
        new_namespace(api, namespace)
        job = tiny_job("tiny")
        base_w = job["spec"]["powerPolicy"]["baseCapWatts"]
        create_job(api, namespace, job)
        # the operator's pods, layout and progress writes pass the policies of an install in
        # OTHER: steps follow
        probes.poll_until(lambda: job_status(api, namespace, "tiny"),
                          lambda status: (status.get("step") or 0) >= 2, timeout=HANG_S,
                          interval=1.0, error=lambda last: AssertionError(
                              f"the job trained no steps with Tessera in {OTHER}: {last}"))
        cordon.edit(api, "gpu-node-1", 1, cordon=True)
        probes.poll_until(lambda: limits_w(plane, "gpu-node-1"), lambda w: w[1] == 200,
                          timeout=HANG_S, interval=0.5, error=lambda w: AssertionError(
                              f"the cordoned GPU is not at its minimum: {w}"))

        # users' jobs are not deleted unasked: the hook fails, names the job, and Tessera stays
        refused = helm(plane, "uninstall", "tessera", "--wait", "--timeout", "5m", check=False)
        assert refused.returncode != 0, refused.stdout
        assert "Job/tessera-elsewhere/tessera-uninstall" in refused.stderr, refused.stderr
        said = run(["kubectl", "logs", "-n", OTHER, "job/tessera-uninstall"], plane.kubeconfig)
        assert f"{namespace}/tiny" in said.stdout + said.stderr, said
        step = job_status(api, namespace, "tiny")["step"]
        probes.poll_until(lambda: job_status(api, namespace, "tiny"),
                          lambda status: (status.get("step") or 0) > step, timeout=HANG_S,
                          interval=1.0, error=lambda last: AssertionError(
                              f"the job stopped training after the refused uninstall: {last}"))
        # its owner deletes it (while it trains), and the uninstall is run again
        run(["kubectl", "delete", "ntptrainingjob", "tiny", "-n", namespace, "--wait=false"],
            plane.kubeconfig)

        started = time.monotonic()
        done = helm(plane, "uninstall", "tessera", "--wait", "--timeout", "5m", check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        print(f"helm uninstall with a job training: {time.monotonic() - started:.0f} s")
        # the hook deleted the job while the operator ran; the job's pods go with it
        custom = client.CustomObjectsApi(api)
        assert custom.list_cluster_custom_object(GROUP, VERSION, JOB_PLURAL)["items"] == []
        core = client.CoreV1Api(api)
        # the operator released the job's power targets before it went
        assert custom.list_cluster_custom_object(GROUP, VERSION, POWER_TARGET_PLURAL)[
            "items"] == []
        # pods go after their owners, the job's and the install's
        for where in (namespace, OTHER):
            probes.poll_until(lambda where=where: core.list_namespaced_pod(where).items,
                              lambda left: not left, timeout=HANG_S, error=lambda left: (
                                  AssertionError(f"pods left: {[p.metadata.name for p in left]}")))
        # the power agents gone, every GPU of the job's nodes stays at the base cap: the
        # cordoned one was raised from its minimum, the boosted one cut
        after = {node: limits_w(plane, node) for node in ("gpu-node-0", "gpu-node-1")}
        print(f"GPU limits after the uninstall: {after}")
        assert after == {node: [base_w] * GPUS for node in after}, after
        # the operator's leader deleted its Lease as it stopped
        with pytest.raises(client.ApiException) as lease:
            client.CoordinationV1Api(api).read_namespaced_lease(leader.LEASE_NAME, OTHER)
        assert lease.value.status == 404
        # Helm keeps the namespace (its release record lives there): nothing of Tessera in it,
        # and deleting it completes
        assert run(["kubectl", "get", "-n", OTHER, "-o", "name",
                    "-l", "app.kubernetes.io/part-of=tessera",
                    "all,serviceaccounts,roles,rolebindings,configmaps,jobs"],
                   plane.kubeconfig).stdout == ""
        run(["kubectl", "delete", "namespace", OTHER, "--wait", "--timeout=120s"],
            plane.kubeconfig)
        admission = client.AdmissionregistrationV1Api(api)
        assert not [p.metadata.name for p in admission.list_validating_admission_policy().items
                    if p.metadata.name.startswith("tessera-")]
        assert not [b.metadata.name for b in
                    admission.list_validating_admission_policy_binding().items
                    if b.metadata.name.startswith("tessera-")]
        rbac = client.RbacAuthorizationV1Api(api)
        assert not rbac.list_cluster_role(label_selector="app.kubernetes.io/part-of=tessera").items
        # manifests/local's Role in the exporter's namespace goes with the release
        assert not rbac.list_namespaced_role(
            "gpu-operator", label_selector="app.kubernetes.io/part-of=tessera").items
        # the cluster's RuntimeClass is the GPU Operator's, not the release's
        client.NodeV1Api(api).read_runtime_class("nvidia")
        # the policies' bindings are gone with their param: ConfigMaps are written as before
        core.create_namespaced_config_map(namespace, {"metadata": {"name": "after-uninstall"}})

        # the CRDs are kept (crds.keep) and, with no object left on a finalizer, deletable
        run(["kubectl", "delete", "crd", *TESSERA_CRDS, "--wait", "--timeout=120s"],
            plane.kubeconfig)
