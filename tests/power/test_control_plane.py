"""The power channel on a real kube-apiserver: RBAC and admission from the shipped manifests, the
CRD's schema, the operator's staged writes (`sync_targets`), and real agent processes boosting
and releasing simulated GPUs, reporting what is in effect, settling them on SIGTERM, after a crash
and when their target goes, and moving a boost across the nodes of one rack within its budget."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from powertest import create_target
from prometheus_client.parser import text_string_to_metric_families
from tcp_proxy import Proxy

from tessera_agents.power import target_source
from tessera_agents.power.main import _parser
from tessera_agents.power.sim_backend import SimBackend
from tessera_agents.power.state import ManagedGpus
from tessera_contracts.powertarget import PowerTarget, to_object
from tessera_dev import probes, processes
from tessera_dev.controlplane.launcher import SERVICE_ACCOUNT_ISSUER
from tessera_operator import power_targets
from tessera_operator.power_planning import PowerPolicy, plan_rack, ratio_for_tp

pytestmark = pytest.mark.power

ROOT = Path(__file__).resolve().parents[2]
NS = "tessera-system"
OPERATOR, AGENT = "tessera-operator", "tessera-power-agent"
W = 1000
JOB_LABEL = ("tessera.dev/job", "power-test")


def _policy() -> PowerPolicy:
    return PowerPolicy(base_w=500, boost_cap_w=700, rack_budget_w=4600)


def _targets(node: str, failed: set[int]) -> PowerTarget:
    return plan_rack(_policy(), "rack-a", {node: 8}, {(node, i) for i in failed},
                     ratio_for_tp(8, 7))[node]


def _owner() -> dict:
    return {"apiVersion": "tessera.dev/v1alpha1", "kind": "NTPTrainingJob", "name": "power-test",
            "uid": str(uuid.uuid4())}


def _sync(operator: client.ApiClient, owner: dict, desired: list) -> power_targets.SyncResult:
    """The operator's write of a job's targets."""
    return power_targets.sync_targets(operator, desired, job_owner=owner, job_label=JOB_LABEL,
                                timeout_s=10)


def _set_target(operator: client.ApiClient, owner: dict, target: PowerTarget) -> None:
    """A node alone in its rack: one sync puts its target in place, cut or raise."""
    assert not _sync(operator, owner, [target]).pending


def _node() -> str:
    return f"gpu-node-{uuid.uuid4().hex[:8]}"


def _node_token(admin: client.ApiClient, node: str) -> str:
    """The agent's service-account token as its DaemonSet pod receives it: bound to a pod on
    `node` (a new Node object), which names the node in the token; the admission policy lets it
    write that node's status."""
    core = client.CoreV1Api(admin)
    core.create_node({"metadata": {"name": node}})
    pod = core.create_namespaced_pod(NS, {
        "metadata": {"name": f"{AGENT}-{node}"},
        "spec": {"nodeName": node, "serviceAccountName": AGENT,
                 "containers": [{"name": "agent", "image": "tessera-power-agent:0.1.0"}]}})
    ref = {"kind": "Pod", "apiVersion": "v1", "name": pod.metadata.name, "uid": pod.metadata.uid}
    request = {"spec": {"audiences": [SERVICE_ACCOUNT_ISSUER], "expirationSeconds": 3600,
                        "boundObjectRef": ref}}
    return core.create_namespaced_service_account_token(AGENT, NS, request).status.token


def _token_client(control_plane, token: str) -> client.ApiClient:
    from kubernetes import config

    return config.new_client_from_config_dict(
        control_plane.token_kubeconfig(token, f"system:serviceaccount:{NS}:{AGENT}"))


def test_shipped_daemonset_runs_the_agent_as_configured(
    admin_api: client.ApiClient, power_api
) -> None:
    """The DaemonSet the API server accepted starts an agent its own parser accepts, bound to the
    reader role, whose shutdown fits the grace period."""
    pod = client.AppsV1Api(admin_api).read_namespaced_daemon_set(AGENT, NS).spec.template.spec
    args = _parser().parse_args([*pod.containers[0].args, "--node", "n"])
    assert args.api_timeout + args.restore_timeout < pod.termination_grace_period_seconds
    binding = client.RbacAuthorizationV1Api(admin_api).read_cluster_role_binding(AGENT)
    assert binding.role_ref.name == "tessera-power-target-reader"
    assert [(s.namespace, s.name) for s in binding.subjects] == [(NS, pod.service_account_name)]


def test_only_the_operator_may_write_targets(power_api, namespace: str) -> None:
    node = _node()
    workload = power_api(namespace, "trainer")
    with pytest.raises(ApiException) as denied:
        create_target(workload, _targets(node, set()))
    assert denied.value.status == 403

    operator = power_api(NS, OPERATOR)
    create_target(operator, _targets(node, set()))

    agent = power_api(NS, AGENT)
    assert power_targets.fetch(agent, node)["spec"]["baseWatts"] == 500
    source = target_source.KubeTargetSource(agent, node, timeout_s=5)  # what the agent watches
    try:
        assert source.fetch()["spec"]["baseWatts"] == 500
    finally:
        source.close()
    with pytest.raises(ApiException) as denied:
        create_target(agent, _targets(node, {0}))
    assert denied.value.status == 403
    for attempt in (
        lambda: client.CustomObjectsApi(agent).patch_cluster_custom_object(
            "tessera.dev", "v1alpha1", "gpupowertargets", node, {"spec": {"baseWatts": 700}}),
        lambda: power_targets.withdraw(agent, node),
    ):
        with pytest.raises(ApiException) as denied:
            attempt()
        assert denied.value.status == 403
    assert power_targets.fetch(agent, node)["spec"]["baseWatts"] == 500
    power_targets.withdraw(operator, node)
    assert power_targets.fetch(agent, node) is None


def _write_status(api: client.ApiClient, node: str) -> None:
    client.CustomObjectsApi(api).patch_cluster_custom_object_status(
        "tessera.dev", "v1alpha1", "gpupowertargets", node,
        {"status": {"appliedGeneration": 1, "state": "Applied"}})


def test_an_agent_may_write_only_its_own_nodes_status(
    control_plane, admin_api: client.ApiClient, power_api
) -> None:
    operator, mine, other = power_api(NS, OPERATOR), _node(), _node()
    for node in (mine, other):
        create_target(operator, _targets(node, set()))
    agent = _token_client(control_plane, _node_token(admin_api, mine))
    try:
        _write_status(agent, mine)
        assert power_targets.fetch(operator, mine)["status"]["state"] == "Applied"
        for attempt, why in (
            (lambda: _write_status(agent, other), "only the status of its own node"),
            (lambda: client.CustomObjectsApi(agent).patch_cluster_custom_object(
                "tessera.dev", "v1alpha1", "gpupowertargets", mine, {"spec": {"baseWatts": 700}}),
             ""),  # RBAC: no patch of the spec at all
            (lambda: _write_status(power_api(NS, AGENT), mine), "only the status of its own"),
        ):
            with pytest.raises(ApiException) as denied:
                attempt()
            assert denied.value.status == 403 and why in denied.value.body
        assert "status" not in power_targets.fetch(operator, other)
        assert power_targets.fetch(operator, mine)["spec"]["baseWatts"] == 500
    finally:
        agent.close()
        for node in (mine, other):
            power_targets.withdraw(operator, node)


@pytest.mark.hardening
def test_an_agents_status_lands_only_on_the_object_it_acted_on(
    control_plane, admin_api: client.ApiClient, power_api
) -> None:
    """A status written for a target deleted since is refused, not put on the target created
    again under the node's name: that one may have another spec at the same generation, and
    a status saying it is in effect would let the operator raise the rest of the rack."""
    operator, node = power_api(NS, OPERATOR), _node()
    old = create_target(operator, _targets(node, set()))
    power_targets.withdraw(operator, node)
    new = create_target(operator, _targets(node, {1}))
    agent = _token_client(control_plane, _node_token(admin_api, node))
    source = target_source.KubeTargetSource(agent, node, timeout_s=5)
    status = {"observedGeneration": 1, "appliedGeneration": 1, "state": "Applied"}
    try:
        with pytest.raises(target_source.SourceError, match="422"):
            source.report(status, old["metadata"]["uid"])
        assert "status" not in power_targets.fetch(operator, node)
        source.report(status, new["metadata"]["uid"])
        assert power_targets.fetch(operator, node)["status"] == status
    finally:
        source.close()
        agent.close()
        power_targets.withdraw(operator, node)


def test_admission_policy_refuses_writers_that_rbac_lets_through(
    admin_api: client.ApiClient, power_api, namespace: str
) -> None:
    """A careless wildcard role on tessera.dev must still not let a user raise GPU power."""
    rbac = client.RbacAuthorizationV1Api(admin_api)
    role = f"tessera-dev-editor-{namespace}"
    rbac.create_cluster_role({"metadata": {"name": role}, "rules": [
        {"apiGroups": ["tessera.dev"], "resources": ["*"], "verbs": ["*"]}]})
    rbac.create_cluster_role_binding({
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": "editor", "namespace": namespace}]})
    editor, node = power_api(namespace, "editor"), _node()

    def refused() -> bool:
        try:
            create_target(editor, _targets(node, set()))
        except ApiException as err:
            assert err.status == 403, err
            return "only the Tessera operator" in err.body
        power_targets.withdraw(power_api(NS, OPERATOR), node)
        return False

    _wait("the admission policy to take effect", refused, timeout=15)
    assert power_targets.fetch(editor, node) is None  # reading stays allowed by the wildcard role
    create_target(power_api(NS, OPERATOR), _targets(node, set()))
    power_targets.withdraw(power_api(NS, OPERATOR), node)


def test_unreachable_api_server_fails_fast_as_a_source_error() -> None:
    from kubernetes.client import Configuration

    config = Configuration(host=f"https://127.0.0.1:{_free_port()}")
    config.retries = 0
    source = target_source.KubeTargetSource(client.ApiClient(config), "any", timeout_s=2)
    started = time.monotonic()
    try:
        with pytest.raises(target_source.SourceError, match="unreachable"):
            source.fetch()
        assert time.monotonic() - started < 3
        with pytest.raises(target_source.SourceError, match="unreachable"):
            source.fetch()  # still not known: never taken for "no target"
    finally:
        source.close()


def test_a_rewritten_target_replaces_the_whole_spec(power_api) -> None:
    """Boosts and a ramp step the new plan leaves out are gone from the spec, whether the
    operator set them or another writer did (say an administrator's `kubectl edit`)."""
    operator, owner, node = power_api(NS, OPERATOR), _owner(), _node()
    boosted = replace(_targets(node, {1}), ramp_step_w=10)
    _set_target(operator, owner, boosted)
    _set_target(operator, owner, _targets(node, set()))
    spec = power_targets.fetch(operator, node)["spec"]
    assert not spec.get("gpus") and "rampStepWatts" not in spec
    power_targets.withdraw(operator, node)

    create_target(operator, boosted)  # not the operator's field manager
    _set_target(operator, owner, _targets(node, set()))
    spec = power_targets.fetch(operator, node)["spec"]
    assert not spec.get("gpus") and "rampStepWatts" not in spec
    power_targets.withdraw(operator, node)


@pytest.mark.parametrize(
    ("field", "value"),
    [("budgetWatts", 5000), ("baseWatts", 9000), ("gpus", [{"index": 99, "watts": 600}])],
)
def test_api_server_rejects_out_of_schema_targets(power_api, field: str, value) -> None:
    body = to_object(_targets(_node(), set()))
    body["spec"][field] = value
    with pytest.raises(ApiException) as rejected:
        client.CustomObjectsApi(power_api(NS, OPERATOR)).create_cluster_custom_object(
            "tessera.dev", "v1alpha1", "gpupowertargets", body)
    assert rejected.value.status == 422


# --- a real agent process ------------------------------------------------------------------


def _free_port() -> int:
    return processes.free_ports(1)[0]


def _wait(what: str, condition: Callable[[], bool], timeout: float = 20.0) -> None:
    probes.poll_until(condition, timeout=timeout,
                      error=lambda _: AssertionError(f"timed out waiting for {what}"))


class AgentProcess:
    """`tessera power-agent --backend sim` as the agent's service account, with a token bound to
    its node (as a DaemonSet pod's is)."""

    def __init__(self, control_plane, tmp: Path, node: str) -> None:
        with control_plane.api_client() as admin:
            token = _node_token(admin, node)
        self.proxy = Proxy(int(control_plane.server.rsplit(":", 1)[1]))
        config = control_plane.token_kubeconfig(token, f"system:serviceaccount:{NS}:{AGENT}")
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{self.proxy.port}"
        self.kubeconfig = tmp / "agent.kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.sim_state, self.state_dir, self.node = tmp / "gpus.json", tmp / "state", node
        self.port = _free_port()
        self.gpus = SimBackend(8, node, state_path=self.sim_state)
        self.proc: subprocess.Popen | None = None

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "tessera_cli.main", "power-agent", "--node", self.node,
                "--backend", "sim", "--sim-state", str(self.sim_state),
                "--state-dir", str(self.state_dir), "--kubeconfig", str(self.kubeconfig),
                "--interval", "0.2", "--step-watts", "100", "--metrics-addr", "127.0.0.1",
                "--metrics-port", str(self.port), "--startup-wait", "2", *extra]

    def start(self, *extra: str) -> None:
        self.proc = subprocess.Popen(
            self.command(*extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def metrics(self) -> str:
        """The agent's metrics page; empty while it is not serving yet."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                return r.read().decode()
        except urllib.error.URLError:
            return ""

    def stop(self, sig: int) -> tuple[int, str]:
        assert self.proc is not None
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=15)
        return self.proc.returncode, out

    def managed(self) -> dict[str, int | None]:
        return ManagedGpus.load(self.state_dir / f"{self.node}.json").gpus

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proxy.close()


@pytest.fixture
def agent(control_plane, power_api, tmp_path: Path) -> Iterator[AgentProcess]:
    a = AgentProcess(control_plane, tmp_path, _node())
    yield a
    a.close()
    power_targets.withdraw(power_api(NS, OPERATOR), a.node)


def _in_effect(obj) -> bool:
    return obj is not None and (obj.get("status") or {}).get("appliedGeneration") == \
        obj["metadata"]["generation"]


def test_boost_release_and_sigterm_restore_through_the_api(agent: AgentProcess, power_api) -> None:
    operator, owner = power_api(NS, OPERATOR), _owner()
    _set_target(operator, owner, _targets(agent.node, set()))
    agent.start()
    _wait("base cap", lambda: agent.gpus.limits_mw() == [500 * W] * 8)
    base_clock = agent.gpus.read(0).sm_clock_mhz

    # GPU 5 fails: the operator boosts the 7 survivors for TP 8 -> 7, paid by GPU 5's budget.
    degraded = _targets(agent.node, {5})
    _set_target(operator, owner, degraded)
    boost = degraded.gpu_w[0] * W
    _wait("boost", lambda: agent.gpus.limits_mw() == [boost] * 5 + [200 * W] + [boost] * 2)
    assert sum(agent.gpus.limits_mw()) <= _policy().rack_budget_w * W
    # The agent reports what is in effect in the target's status.
    _wait("status", lambda: (power_targets.fetch(operator, agent.node).get("status") or {})
          .get("state")
          == "Applied")
    status = power_targets.fetch(operator, agent.node)["status"]
    assert _in_effect(power_targets.fetch(operator, agent.node))
    assert status["limitWatts"] == sum(agent.gpus.limits_mw()) // W
    assert [g["limitWatts"] for g in status["gpus"]] == [w // W for w in agent.gpus.limits_mw()]
    # Each survivor does 8/7 of a healthy GPU's work, at the speed its SM clock allows: the
    # reduced replica keeps pace if the clock rose by 8/7, less the whole-watt boost (<= 1 W,
    # ~0.15% of speed at this slope) and the whole-MHz clock (~0.07%).
    assert agent.gpus.read(0).sm_clock_mhz / base_clock >= 8 / 7 * (1 - 0.003)
    text = agent.metrics()
    assert f'tessera_gpu_power_boosted{{gpu="0",node="{agent.node}"' in text
    assert f'tessera_gpu_power_target_watts{{gpu="0",node="{agent.node}"' in text

    # The GPU is back: release to the base cap.
    _set_target(operator, owner, _targets(agent.node, set()))
    _wait("release", lambda: agent.gpus.limits_mw() == [500 * W] * 8)

    # Boosted again, GPU 7 falls off the bus just before the node is drained: the others
    # still settle at the base cap inside the node's share, never at their 700 W defaults.
    _set_target(operator, owner, degraded)
    _wait("boost", lambda: agent.gpus.limits_mw() == [boost] * 5 + [200 * W] + [boost] * 2)
    lost = agent.gpus.gpus()[7].uuid
    agent.gpus.inject(7, "gpu_lost")
    started = time.monotonic()
    code, out = agent.stop(signal.SIGTERM)
    assert code == 1 and f"could not settle 1 GPU(s): ['{lost}']" in out, out
    assert time.monotonic() - started < 10  # well inside the DaemonSet's 30 s grace period
    # GPU 5, held at its minimum by the plan, is raised to the base cap: the share holds it
    assert agent.gpus.limits_mw() == [500 * W] * 7 + [boost]
    assert sum(agent.gpus.limits_mw()) <= _policy().rack_budget_w * W
    assert len(agent.managed()) == 8  # for the next agent


@pytest.mark.hardening
def test_a_target_created_again_with_the_same_spec_gets_its_status(
    agent: AgentProcess, power_api
) -> None:
    """Deleted and created again with the same spec, a target is a new object at generation 1
    whose status would read exactly as the old one's did: the agent still writes it, since in a
    rack across nodes the operator's raises wait on it."""
    operator, owner = power_api(NS, OPERATOR), _owner()
    target = _targets(agent.node, set())
    _set_target(operator, owner, target)
    agent.start()
    _wait("the status", lambda: _in_effect(power_targets.fetch(operator, agent.node)))
    first = power_targets.fetch(operator, agent.node)

    power_targets.withdraw(operator, agent.node)
    _set_target(operator, owner, target)
    again = power_targets.fetch(operator, agent.node)
    assert again["metadata"]["generation"] == first["metadata"]["generation"]
    assert again["metadata"]["uid"] != first["metadata"]["uid"] and "status" not in again
    _wait("the new object's status",
          lambda: _in_effect(power_targets.fetch(operator, agent.node)), timeout=30)
    assert power_targets.fetch(operator, agent.node)["status"] == first["status"]


def _boosted(agent: AgentProcess, operator, owner, *args: str) -> PowerTarget:
    """Start the agent under a target boosting around GPU 2 and wait for every GPU to reach
    its target: the sim GPUs start at their 700 W default, above the boost, so "above the base
    cap" alone would hold before the agent touched them."""
    degraded = _targets(agent.node, {2})
    _set_target(operator, owner, degraded)
    agent.start(*args)
    _wait("boost", lambda: agent.gpus.limits_mw() == [degraded.watts_for(i) * W
                                                       for i in range(8)])
    return degraded


def test_a_deleted_target_ends_the_boost_inside_the_share(agent: AgentProcess, power_api) -> None:
    operator, owner = power_api(NS, OPERATOR), _owner()
    degraded = _boosted(agent, operator, owner)
    power_targets.withdraw(operator, agent.node)  # e.g. the node left the job
    _wait("settled at the base cap", lambda: agent.gpus.limits_mw() == [500 * W] * 8)
    assert _sample(agent.metrics(), "tessera_node_power_budget_watts") == degraded.budget_w


def test_crashed_agent_is_undone_by_the_next_one(agent: AgentProcess, power_api) -> None:
    operator, owner = power_api(NS, OPERATOR), _owner()
    _boosted(agent, operator, owner)
    agent.stop(signal.SIGKILL)
    assert agent.gpus.limits_mw()[2] == 200 * W  # nobody restored anything
    assert len(agent.managed()) == 8

    power_targets.withdraw(operator, agent.node)  # the node released: the new agent settles
    agent.start()
    _wait("settled by the next agent", lambda: agent.gpus.limits_mw() == [500 * W] * 8)
    code, out = agent.stop(signal.SIGTERM)
    assert code == 0 and "settling 8 GPU(s) a previous agent changed" in out, out
    assert agent.gpus.limits_mw() == [500 * W] * 8  # never the 700 W defaults


def test_rolling_update_hands_the_boost_over_and_a_second_agent_is_refused(
    agent: AgentProcess, power_api
) -> None:
    operator, owner = power_api(NS, OPERATOR), _owner()
    degraded = _boosted(agent, operator, owner, "--on-exit", "hold")
    boosted = [degraded.watts_for(i) * W for i in range(8)]

    second = subprocess.run(agent.command("--metrics-port", "0"), capture_output=True, text=True,
                            timeout=30)
    assert second.returncode == 2 and "locked by another power agent" in second.stderr
    assert agent.proc.poll() is None and agent.gpus.limits_mw() == boosted

    code, out = agent.stop(signal.SIGTERM)  # --on-exit hold: nothing restored
    assert code == 0, out
    assert agent.gpus.limits_mw() == boosted and len(agent.managed()) == 8
    agent.start()
    _wait("adopted", lambda: _sample(agent.metrics(), "tessera_power_agent_holding") == 0.0)
    assert agent.gpus.limits_mw() == boosted  # never back to the 700 W defaults in between
    # --on-exit restore: the boost ends with the agent, and the GPU held at its minimum is back
    # at the base cap
    code, out = agent.stop(signal.SIGTERM)
    assert code == 0 and "adopting 8 GPU(s)" in out, out
    assert agent.gpus.limits_mw() == [500 * W] * 8


def _sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_agent_rides_out_an_api_server_outage(agent: AgentProcess, power_api) -> None:
    operator, owner = power_api(NS, OPERATOR), _owner()
    agent.start()
    degraded = _targets(agent.node, {5})
    _set_target(operator, owner, degraded)
    boosted = [degraded.watts_for(i) * W for i in range(8)]
    _wait("boost", lambda: agent.gpus.limits_mw() == boosted)

    # The API server black-holes: every call must time out, the loop keep going, and the last
    # target it read stay in force.
    agent.proxy.cut()
    _wait("errors counted", lambda: (_sample(agent.metrics(), "tessera_power_agent_errors_total",
                                             kind="SourceError") or 0) >= 2)
    assert agent.gpus.limits_mw() == boosted
    assert _sample(agent.metrics(), "tessera_power_agent_holding") == 0.0

    # Back online: the agent picks up the operator's release.
    _set_target(operator, owner, _targets(agent.node, set()))
    agent.proxy.mend()
    _wait("release after the outage", lambda: agent.gpus.limits_mw() == [500 * W] * 8)

    # Shutdown during an outage is not delayed by it: no API call on the way out.
    agent.proxy.cut()
    started = time.monotonic()
    code, out = agent.stop(signal.SIGTERM)
    assert code == 0, out
    assert time.monotonic() - started < 10
    assert agent.gpus.limits_mw() == [500 * W] * 8
    assert "SourceError" in out or "unreachable" in out


# --- the operator's staged writes, and a boost moving across the nodes of one rack ---------

def _report_in_effect(admin: client.ApiClient, node: str) -> None:
    """What the node's agent writes once its GPUs are within the current spec's budget."""
    generation = power_targets.fetch(admin, node)["metadata"]["generation"]
    client.CustomObjectsApi(admin).patch_cluster_custom_object_status(
        "tessera.dev", "v1alpha1", "gpupowertargets", node,
        {"status": {"observedGeneration": generation, "appliedGeneration": generation,
                    "state": "Applied"}})


def test_sync_targets_writes_changes_only_and_raises_after_the_cuts_are_reported(
    admin_api: client.ApiClient, power_api
) -> None:
    operator, a, b, owner = power_api(NS, OPERATOR), _node(), _node(), _owner()
    policy = PowerPolicy(base_w=500, boost_cap_w=700, rack_budget_w=8000)

    def plan(failed: set) -> list:
        return list(plan_rack(policy, "rack-x", {a: 8, b: 8}, failed, 1.3).values())

    sync = functools.partial(_sync, operator, owner)
    boost_on_b = plan({(a, 0)})
    first = sync(boost_on_b)
    assert first.written == tuple(sorted((a, b))) and first.pending
    objs = {n: power_targets.fetch(operator, n) for n in (a, b)}
    for obj in objs.values():  # a rack of two nodes: each enters at every GPU's minimum
        assert (obj["spec"]["baseWatts"], obj["spec"]["gpus"]) == (1, [])
        assert obj["metadata"]["labels"][JOB_LABEL[0]] == JOB_LABEL[1]
        assert obj["metadata"]["labels"][power_targets.JOB_UID_LABEL] == owner["uid"]
        assert ("tessera-operator", "Apply") in {
            (m["manager"], m["operation"]) for m in obj["metadata"]["managedFields"]}
    assert sync(boost_on_b).written == ()  # nothing reported yet: the raises wait
    for n in (a, b):
        _report_in_effect(admin_api, n)
    second = sync(boost_on_b)
    assert second.written == tuple(sorted((a, b))) and not second.pending
    versions = {n: power_targets.fetch(operator, n)["metadata"]["resourceVersion"] for n in (a, b)}
    assert sync(boost_on_b) == power_targets.SyncResult((), (), ())  # no change, no write
    assert versions == {n: power_targets.fetch(operator, n)["metadata"]["resourceVersion"]
                        for n in (a, b)}

    # GPU 0 moves from a to b: a's share grows, b's shrinks; a waits for b's cut.
    for n in (a, b):
        _report_in_effect(admin_api, n)
    boost_on_a = plan({(b, 0)})
    assert sync(boost_on_a) == power_targets.SyncResult((b,), (), (a,))
    assert sync(boost_on_a) == power_targets.SyncResult((), (), (a,))
    _report_in_effect(admin_api, b)
    assert sync(boost_on_a) == power_targets.SyncResult((a,), (), ())
    specs = {n: power_targets.fetch(operator, n)["spec"] for n in (a, b)}
    assert {n: s["budgetWatts"] for n, s in specs.items()} == {
        t.node: t.budget_w for t in boost_on_a}

    # a leaves the job while b stays in the rack: a keeps its share, settled (no boost), and
    # b's share cannot grow past the one planned with a; then the job ends: their targets go.
    left = sync([replace(t, budget_w=t.budget_w + 100) for t in boost_on_a if t.node == b])
    assert left == power_targets.SyncResult((a,), (), (b,))
    spec = power_targets.fetch(operator, a)["spec"]
    assert (spec.get("gpus", []), spec["budgetWatts"]) == ([], specs[a]["budgetWatts"])
    assert sync([]).deleted == tuple(sorted((a, b)))
    assert power_targets.fetch(operator, a) is None and power_targets.fetch(operator, b) is None


class RackSampler:
    """Sums the power limits of every GPU of a rack's nodes as fast as it can read them."""

    def __init__(self, agents: list[AgentProcess]) -> None:
        self._gpus = [a.gpus for a in agents]
        self.samples, self.highest_mw = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = sum(sum(g.limits_mw()) for g in self._gpus)
            self.samples, self.highest_mw = self.samples + 1, max(self.highest_mw, total)

    def __enter__(self) -> RackSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_boost_moves_across_a_racks_nodes_within_its_budget(
    control_plane, power_api, tmp_path: Path
) -> None:
    """Three agent processes, one rack across their nodes, a budget that binds: as a failed GPU
    moves from node to node (and the boost with it), even past an agent that stalls, the sampled
    sum of the rack's limits never exceeds the budget, and every node ends at its plan."""
    operator, owner = power_api(NS, OPERATOR), _owner()
    agents = []
    for i in range(3):
        (tmp_path / f"n{i}").mkdir()
        agents.append(AgentProcess(control_plane, tmp_path / f"n{i}", _node()))
    nodes = [a.node for a in agents]
    budget_w = 24 * 500  # binds: 23 survivors at 1.3x the base cap would need more
    policy = PowerPolicy(base_w=500, boost_cap_w=700, rack_budget_w=budget_w)

    def plan(failed_node: str) -> list:
        return list(plan_rack(policy, "rack-y", dict.fromkeys(nodes, 8), {(failed_node, 3)},
                              1.3).values())

    sync = functools.partial(_sync, operator, owner)

    def converge(failed_node: str) -> None:
        desired = plan(failed_node)
        want = {t.node: [t.watts_for(i) * W for i in range(8)] for t in desired}

        def done() -> bool:
            return not sync(desired).pending and all(
                a.gpus.limits_mw() == want[a.node] for a in agents)

        _wait(f"the boost around {failed_node}'s failed GPU", done, timeout=60)
        # the failed GPU's watts went to the other nodes' survivors
        assert sum(want[failed_node]) < min(sum(want[n]) for n in nodes if n != failed_node)

    def acted_on_its_spec(node: str) -> bool:
        obj = power_targets.fetch(operator, node)
        return (obj.get("status") or {}).get("observedGeneration") == \
            obj["metadata"]["generation"]

    try:
        for a in agents:
            a.start()
        converge(nodes[0])  # from the 700 W defaults (over any budget) to the plan
        with RackSampler(agents) as sampler:
            # Node 1's agent stalls as node 1's GPU takes the failure from node 0's: node 1
            # must cut before node 0 raises, so node 0's raise waits, whatever node 0 does.
            agents[1].proc.send_signal(signal.SIGSTOP)
            assert sync(plan(nodes[1])) == power_targets.SyncResult((nodes[1],), (), (nodes[0],))
            _wait("node 0's agent acting on its current spec",
                  lambda: acted_on_its_spec(nodes[0]))
            agents[1].proc.send_signal(signal.SIGCONT)
            converge(nodes[1])
            converge(nodes[2])
            converge(nodes[0])
        assert sampler.highest_mw <= budget_w * W, sampler.highest_mw
        assert sampler.samples > 100  # the moves were watched, not just their ends
    finally:
        sync([])
        for a in agents:
            a.close()
