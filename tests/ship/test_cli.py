"""The user's command line: `tessera` and the `kubectl ntp` plugin start without the kubernetes
client or torch, kubectl finds the plugin, and against a real kube-apiserver `kubectl ntp status`
shows what the job's objects say, `--context` picks the cluster, and cordon / uncordon change the
cordon the operator reads."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from prometheus_client import CollectorRegistry, generate_latest

from tessera_agents.power.metrics import AgentCollector, GpuStatus, NodeStatus
from tessera_cli import settled
from tessera_contracts import gpuhealth, powertarget
from tessera_contracts.api import (
    CORDON_ANNOTATION,
    GPU_HEALTH_PLURAL,
    GROUP,
    JOB_PLURAL,
    VERSION,
)
from tessera_contracts.api import POWER_TARGET_PLURAL as TARGETS
from tessera_contracts.progress import NodeReport, State, progress_configmap, report_key
from tessera_dev import paths, probes, processes
from tessera_dev.controlplane import launcher
from tessera_operator.health import from_cordons

pytestmark = pytest.mark.ship

BIN = Path(sys.executable).parent
TESSERA, PLUGIN = BIN / "tessera", BIN / "kubectl-ntp"
EXAMPLE = yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())
# What a command that only answers --help or --version must not load: each costs a large part of
# a second idle, several seconds on a loaded machine.
HEAVY = ("kubernetes", "pydantic", "urllib3", "requests", "torch", "kopf", "numpy")


def _imported(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run an installed console script under `python -X importtime`; the top-level packages it
    imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True,
                          text=True, timeout=120)
    modules = {line.rpartition("|")[2].strip().split(".")[0]
               for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, modules


@pytest.mark.parametrize("argv", [
    (TESSERA, "--help"), (TESSERA, "--version"), (TESSERA, "cordon-gpu", "--help"),
    (TESSERA, "uncordon-gpu", "--help"), (PLUGIN, "--help"), (PLUGIN, "--version"),
    (PLUGIN, "status", "--help"), (PLUGIN, "cordon", "--help"), (PLUGIN, "uncordon", "--help"),
], ids=lambda argv: " ".join([argv[0].name, *argv[1:]]))
def test_help_and_version_load_no_client_and_no_torch(argv: tuple[Path, ...]) -> None:
    assert argv[0].is_file(), f"{argv[0]} is not installed: reinstall the package"
    done, modules = _imported(*map(str, argv))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(("usage:", f"{argv[0].name.replace('-', ' ')} "))
    assert "tessera_cli" in modules  # the measurement saw the command's own imports
    assert not modules.intersection(HEAVY), sorted(modules.intersection(HEAVY))


def _kubectl(*args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl with the package's scripts first on PATH, where it looks for plugins."""
    env = os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_kubectl_finds_the_plugin() -> None:
    shown = _kubectl("ntp", "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: kubectl ntp COMMAND")
    for command in ("status", "cordon", "uncordon"):
        assert f"\n  {command} " in shown.stdout, command
    version = _kubectl("ntp", "--version")
    assert version.stdout == f"kubectl ntp {metadata.version('tessera')}\n", version.stderr


def _node(admin: client.ApiClient, cordoned: str | None = None) -> str:
    """A node with 8 GPUs, as a device plugin reports them through the kubelet."""
    name = f"cli-{uuid.uuid4().hex[:8]}"
    annotations = {} if cordoned is None else {CORDON_ANNOTATION: cordoned}
    core = client.CoreV1Api(admin)
    core.create_node({"metadata": {"name": name, "annotations": annotations}})
    core.patch_node_status(name, {"status": {"capacity": {"nvidia.com/gpu": "8"}}})
    return name


def _job(admin: client.ApiClient, namespace: str, nodes: list[str]) -> str:
    """The example job with the status an operator writes: replica 0 on nodes[0] at TP 7 without
    its cordoned GPU 3, boosted; replica 1 on nodes[1] at TP 8."""
    custom = client.CustomObjectsApi(admin)
    name = f"job-{uuid.uuid4().hex[:8]}"
    body = copy.deepcopy(EXAMPLE) | {"metadata": {"name": name}}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, JOB_PLURAL, body)
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, JOB_PLURAL, name, {
        "status": {"phase": "Degraded", "tpLayout": "7,8", "step": 120, "goodput": 0.934,
                   "layoutGeneration": 2, "attempt": 1,
                   "replicas": [{"index": 0, "tensorParallelSize": 7, "nodes": [nodes[0]],
                                 "failedGPUs": [f"{nodes[0]}/3"], "powerBoosted": True},
                                {"index": 1, "tensorParallelSize": 8, "nodes": [nodes[1]]}]}})
    return name


def _power_and_health(admin: client.ApiClient, node: str) -> None:
    """nodes[0]'s GPUPowerTarget (survivors at 650 W, the cordoned GPU at 100 W) with the limits
    its agent reports, and its GPUHealth (GPU 5 with a recent XID)."""
    custom = client.CustomObjectsApi(admin)
    target = powertarget.PowerTarget(node=node, rack=node, budget_w=4800, base_w=600,
                                     rack_budget_w=4800, gpu_w={i: 650 for i in range(8)} | {
                                         3: 100})
    custom.create_cluster_custom_object(GROUP, VERSION, TARGETS, powertarget.to_object(target))
    limits = {i: w * 1000 for i, w in target.gpu_w.items()} | {0: 640_000}  # 0 still ramping
    custom.patch_cluster_custom_object_status(GROUP, VERSION, TARGETS, node, {
        "status": powertarget.render_status(generation=1, in_effect=True, state="Ramping",
                                            message="", limits_mw=limits)})
    gpus = tuple(gpuhealth.GpuHealth(i, gpuhealth.State.HEALTHY, xids=(43,) if i == 5 else ())
                 for i in range(8))
    custom.create_cluster_custom_object(GROUP, VERSION, GPU_HEALTH_PLURAL, gpuhealth.render(
        gpuhealth.PublishedHealth(node, "http://10.0.0.1:9400/metrics", time.time(),
                                  gpuhealth.NodeHealth(gpus))))


def test_status_shows_the_layout_power_and_goodput(
        admin_api, namespace, tessera_crds, control_plane: launcher.ControlPlane) -> None:
    nodes = [_node(admin_api, cordoned="3"), _node(admin_api)]
    job = _job(admin_api, namespace, nodes)
    _power_and_health(admin_api, nodes[0])
    report = NodeReport(node=nodes[0], generation=2, step=121, steps=1000, state=State.TRAINING,
                        step_seconds=0.5)
    client.CoreV1Api(admin_api).create_namespaced_config_map(namespace, {
        "metadata": {"name": progress_configmap(job)},
        "data": {report_key(nodes[0]): report.to_json()}})

    shown = _kubectl("ntp", "status", job, "-n", namespace, kubeconfig=control_plane.kubeconfig)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert f"NTPTrainingJob {namespace}/{job}: Degraded, step 120 of 1000, goodput 0.934" in out
    assert "Layout planned: TP 7,8 (layout generation 2); none published to the ranks" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["0"][:5] == ["0", "7", nodes[0], f"{nodes[0]}/3", "yes"]
    assert rows["1"][:5] == ["1", "8", nodes[1], "-", "no"]
    # what nodes[0]'s ranks run, its budget and the limits in effect; nodes[1] reports nothing
    assert rows[nodes[0]] == [nodes[0], "2", "Training", "121", "0.50", "4800", "4640",
                              "Ramping"]
    assert rows[nodes[1]][1:] == ["-"] * 7
    # each GPU: cordon, health, target and limit watts
    assert rows[f"{nodes[0]}/3"][1:] == ["cordoned", "Healthy", "100", "100"]
    assert rows[f"{nodes[0]}/0"][1:] == ["-", "Healthy", "650", "640"]
    assert rows[f"{nodes[0]}/5"][1:] == ["-", "Healthy", "(XID", "43)", "650", "650"]
    assert rows[f"{nodes[1]}/7"][1:] == ["-", "Unknown", "(no", "GPUHealth)", "-", "-"]

    missing = _kubectl("ntp", "status", "nope", "-n", namespace,
                       kubeconfig=control_plane.kubeconfig)
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr == (f"kubectl ntp status: no NTPTrainingJob 'nope' in namespace "
                              f"{namespace!r}\n")


def _two_contexts(plane: launcher.ControlPlane, path: Path) -> Path:
    """The admin's kubeconfig with a second context, `wrong`, whose server nothing listens on;
    `wrong` is the current one, so only --context right reaches the cluster."""
    config = yaml.safe_load(plane.kubeconfig.read_text())
    right = config["contexts"][0]
    cluster = copy.deepcopy(config["clusters"][0])
    cluster["name"] = "nowhere"
    cluster["cluster"]["server"] = f"https://127.0.0.1:{processes.free_ports(1)[0]}"
    config["clusters"].append(cluster)
    config["contexts"] = [{"name": "right", "context": right["context"]},
                          {"name": "wrong", "context": right["context"] | {"cluster": "nowhere"}}]
    config["current-context"] = "wrong"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def test_context_selects_the_cluster(admin_api, namespace, tessera_crds, control_plane,
                                     tmp_path) -> None:
    kubeconfig = _two_contexts(control_plane, tmp_path / "kubeconfig")
    nodes = [_node(admin_api), _node(admin_api)]
    job = _job(admin_api, namespace, nodes)
    status = ("ntp", "status", job, "-n", namespace, "--kubeconfig", str(kubeconfig))

    works = _kubectl(*status, "--context", "right")
    assert works.returncode == 0 and "Degraded" in works.stdout, works.stderr
    for context in ("wrong", None):  # named, and as the current context
        fails = _kubectl(*status, *(("--context", context) if context else ()))
        assert fails.returncode == 1 and fails.stdout == ""
        assert fails.stderr.count("\n") == 1 and "Traceback" not in fails.stderr
        assert fails.stderr.startswith("kubectl ntp status: API server https://127.0.0.1:")
        assert "unreachable" in fails.stderr
    absent = _kubectl(*status, "--context", "absent")
    assert absent.returncode == 1 and absent.stderr.count("\n") == 1
    assert "context 'absent'" in absent.stderr and "Traceback" not in absent.stderr

    cordon = _kubectl("ntp", "cordon", nodes[0], "2", "--kubeconfig", str(kubeconfig),
                      "--context", "right")
    assert cordon.returncode == 0, cordon.stderr
    assert _operator_sees(admin_api, nodes[0]) == {2}


def _operator_sees(admin: client.ApiClient, node: str) -> set[int]:
    """The node's GPUs the operator counts cordoned, read as it reads them."""
    read = client.CoreV1Api(admin).read_node(node)
    health = from_cordons([admin.sanitize_for_serialization(read)], 8)
    assert not health.problems, health.problems
    return {index for name, index in health.failed if name == node}


def test_cordon_and_uncordon_through_the_plugin_change_what_the_operator_reads(
        admin_api, control_plane) -> None:
    node = _node(admin_api)
    kubeconfig = control_plane.kubeconfig
    for verb, gpu, after in (("cordon", 3, {3}), ("cordon", 5, {3, 5}), ("cordon", 5, {3, 5}),
                             ("uncordon", 3, {5}), ("uncordon", 5, set())):
        done = _kubectl("ntp", verb, node, str(gpu), kubeconfig=kubeconfig)
        assert done.returncode == 0, done.stderr
        assert _operator_sees(admin_api, node) == after, (verb, gpu)
    wrong = _kubectl("ntp", "cordon", node, "8", kubeconfig=kubeconfig)
    assert (wrong.returncode, wrong.stderr) == (
        1, f"kubectl ntp cordon: node {node} has 8 GPUs (0-7); no GPU 8\n")


def _agent_page(status: NodeStatus) -> str:
    registry = CollectorRegistry()
    registry.register(AgentCollector(lambda: status))
    return generate_latest(registry).decode()


def test_the_uninstall_reads_whether_a_node_is_settled_from_its_power_agents_page() -> None:
    """`tessera uninstall` waits on the page the power agent serves: its settled gauge, and, for
    a node that is not settled, each GPU away from its target or not answering."""
    gpus = (GpuStatus(0, "GPU-0", 400_000, 500_000, 500_000, False),
            GpuStatus(1, "GPU-1", 200_000, 200_000, 500_000, False),
            GpuStatus(2, "GPU-2", None, None, 500_000, False))
    ramping = NodeStatus(node="gpu-node-1", holding=False, gpus=gpus)
    page = settled.parse_page(_agent_page(ramping))
    assert settled.node_left(page, "gpu-node-1") == \
        "GPU 1 at 200 W, settling to 500 W, GPU 2 not answering"
    assert settled.node_left(page, "gpu-node-0") == \
        "not settled yet (its agent still acts on a target)"  # another node's page
    done = NodeStatus(node="gpu-node-1", holding=False, gpus=gpus[:1], settled=True)
    assert settled.node_left(settled.parse_page(_agent_page(done)), "gpu-node-1") is None


def test_the_uninstall_refuses_while_jobs_exist_and_deletes_nothing(
        admin_api, namespace, tessera_crds, control_plane) -> None:
    """Users' jobs are never deleted unasked: with a job in the cluster `tessera uninstall`
    exits 1 naming it, and the job is still there (as is what the operator would have stopped)."""
    job = _job(admin_api, namespace, [_node(admin_api), _node(admin_api)])
    done = subprocess.run([str(TESSERA), "uninstall", "--timeout", "30", "--namespace",
                           namespace, "--kubeconfig", str(control_plane.kubeconfig)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("tessera uninstall: ") and done.stderr.count("\n") == 1
    assert f"{namespace}/{job}" in done.stderr and "--delete-jobs" in done.stderr
    custom = client.CustomObjectsApi(admin_api)
    kept = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, JOB_PLURAL, job)
    assert kept["metadata"].get("deletionTimestamp") is None


def _user(admin: client.ApiClient, plane: launcher.ControlPlane, role: str, namespace: str,
          cluster_wide: bool = False) -> Path:
    """A person's kubeconfig (a client certificate of their own), bound to the ClusterRole
    `role` in `namespace`, or in every namespace."""
    name = f"user-{uuid.uuid4().hex[:8]}"
    binding = {"metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": role},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                             "name": name}]}
    rbac = client.RbacAuthorizationV1Api(admin)
    if cluster_wide:
        rbac.create_cluster_role_binding(binding)
    else:
        rbac.create_namespaced_role_binding(namespace, binding)
    return plane.identity_kubeconfig(name, name)


def _aggregated(admin: client.ApiClient, role: str, verb: str) -> bool:
    """Whether the controller-manager has aggregated Tessera's rules into ClusterRole `role`."""
    rules = client.RbacAuthorizationV1Api(admin).read_cluster_role(role).rules or []
    return any("tessera.dev" in (r.api_groups or []) and "ntptrainingjobs" in r.resources
               and verb in r.verbs for r in rules)


def test_users_bound_to_view_read_jobs_and_their_status_and_to_edit_change_them(
        admin_api, namespace, tessera_crds, control_plane) -> None:
    """manifests/roles aggregated into Kubernetes' own `view` and `edit`: bound to `view` in a
    namespace, a person lists its jobs and runs `kubectl ntp status` (what the role does not
    reach shown as such), and changes nothing; bound to `edit`, they create and delete jobs;
    bound to `view` cluster-wide, they see the GPUs' health and power too."""
    applied = _kubectl("apply", "--server-side", "-k", str(paths.repo_root() / "manifests/roles"),
                       kubeconfig=control_plane.kubeconfig)
    assert applied.returncode == 0, applied.stderr
    for role, verb in (("view", "list"), ("edit", "create"), ("admin", "delete")):
        probes.poll_until(lambda role=role, verb=verb: _aggregated(admin_api, role, verb),
                          timeout=120, interval=0.5, error=lambda _, role=role: AssertionError(
                              f"Tessera's rules never reached ClusterRole {role}"))
    nodes = [_node(admin_api), _node(admin_api)]
    job = _job(admin_api, namespace, nodes)
    _power_and_health(admin_api, nodes[0])

    viewer = _user(admin_api, control_plane, "view", namespace)
    listed = _kubectl("get", "ntptrainingjobs", "-n", namespace, "-o", "name",
                      kubeconfig=viewer)
    assert listed.stdout.split() == [f"ntptrainingjob.tessera.dev/{job}"], listed.stderr
    shown = _kubectl("ntp", "status", job, "-n", namespace, kubeconfig=viewer)
    assert shown.returncode == 0, shown.stderr
    assert f"NTPTrainingJob {namespace}/{job}: Degraded, step 120 of 1000" in shown.stdout
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines() if line.strip()}
    assert rows["0"][:3] == ["0", "7", nodes[0]]
    assert rows[f"{nodes[0]}/3"][1:] == ["?", "?", "?", "?"]
    assert ("Not shown, your roles may not read them: GPUHealths, GPUPowerTargets, Nodes (?)"
            in shown.stdout)
    for verb in ("create", "delete", "patch"):
        can = _kubectl("auth", "can-i", verb, "ntptrainingjobs.tessera.dev", "-n", namespace,
                       kubeconfig=viewer)
        assert can.stdout.strip() == "no", (verb, can.stdout, can.stderr)
    elsewhere = _kubectl("get", "ntptrainingjobs", "-n", "default", kubeconfig=viewer)
    assert elsewhere.returncode == 1 and "forbidden" in elsewhere.stderr

    editor = _user(admin_api, control_plane, "edit", namespace)
    created = subprocess.run(
        ["kubectl", "create", "-n", namespace, "-f", "-"], env=os.environ | {
            "KUBECONFIG": str(editor)}, capture_output=True, text=True, timeout=120,
        input=yaml.safe_dump(copy.deepcopy(EXAMPLE) | {"metadata": {"name": "edited"}}))
    assert created.returncode == 0, created.stderr
    deleted = _kubectl("delete", "ntptrainingjob", "edited", "-n", namespace, "--wait=false",
                       kubeconfig=editor)
    assert deleted.returncode == 0, deleted.stderr

    cluster_viewer = _user(admin_api, control_plane, "view", namespace, cluster_wide=True)
    wide = _kubectl("ntp", "status", job, "-n", namespace, kubeconfig=cluster_viewer)
    assert wide.returncode == 0, wide.stderr
    rows = {line.split()[0]: line.split() for line in wide.stdout.splitlines() if line.strip()}
    assert rows[f"{nodes[0]}/3"][1:] == ["?", "Healthy", "100", "100"]
    assert "Not shown, your roles may not read them: Nodes (?)" in wide.stdout
