"""The power channel on a real kube-apiserver: RBAC from the shipped manifests, the CRD's schema,
and a real agent process boosting and releasing simulated GPUs, restoring them on SIGTERM and
after a crash."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families
from tcp_proxy import Proxy

from power_controller import channel
from power_controller.agent import _parser
from power_controller.planning import PowerPolicy, plan_rack, ratio_for_tp
from power_controller.sim_backend import SimBackend
from power_controller.state import ManagedGpus
from power_controller.targets import to_object
from tessera_operator.controlplane import crds, manifests

pytestmark = pytest.mark.power

ROOT = Path(__file__).resolve().parents[2]
NS = "tessera-system"
OPERATOR, AGENT = "tessera-operator", "tessera-power-agent"
W = 1000


@pytest.fixture(scope="module")
def power_api(control_plane) -> Iterator[Callable[[str, str], client.ApiClient]]:
    """The GPUPowerTarget CRD and the shipped power-controller manifests, applied as shipped;
    yields a factory of clients acting as a service account."""
    with control_plane.api_client() as admin:
        crds.apply(admin, [yaml.safe_load((ROOT / "crds/gpupowertarget.yaml").read_text())])
        manifests.apply(admin, [ROOT / "manifests/power-controller" / name
                                for name in ("rbac.yaml", "admission.yaml", "daemonset.yaml")])
    clients: list[client.ApiClient] = []

    def as_account(namespace: str, name: str) -> client.ApiClient:
        clients.append(control_plane.service_account_client(namespace, name))
        return clients[-1]

    yield as_account
    for c in clients:
        c.close()


def _policy() -> PowerPolicy:
    return PowerPolicy(base_w=500, boost_cap_w=700, rack_budget_w=4600, ttl_s=120)


def _targets(node: str, failed: set[int]):
    return plan_rack(_policy(), "rack-a", {node: 8}, {(node, i) for i in failed},
                     ratio_for_tp(8, 7), datetime.now(UTC))[node]


def _node() -> str:
    return f"gpu-node-{uuid.uuid4().hex[:8]}"


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
        channel.publish(workload, _targets(node, set()))
    assert denied.value.status == 403

    operator = power_api(NS, OPERATOR)
    channel.publish(operator, _targets(node, set()))

    agent = power_api(NS, AGENT)
    assert channel.fetch(agent, node)["spec"]["baseWatts"] == 500
    with pytest.raises(ApiException) as denied:  # its own node's object, nothing more
        client.CustomObjectsApi(agent).list_cluster_custom_object(
            "tessera.dev", "v1alpha1", "gpupowertargets")
    assert denied.value.status == 403
    with pytest.raises(ApiException) as denied:
        channel.publish(agent, _targets(node, {0}))
    assert denied.value.status == 403
    for attempt in (
        lambda: client.CustomObjectsApi(agent).patch_cluster_custom_object(
            "tessera.dev", "v1alpha1", "gpupowertargets", node, {"spec": {"baseWatts": 700}}),
        lambda: channel.withdraw(agent, node),
    ):
        with pytest.raises(ApiException) as denied:
            attempt()
        assert denied.value.status == 403
    assert channel.fetch(agent, node)["spec"]["baseWatts"] == 500
    channel.withdraw(operator, node)
    assert channel.fetch(agent, node) is None


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
            channel.publish(editor, _targets(node, set()))
        except ApiException as err:
            assert err.status == 403, err
            return "only the Tessera operator" in err.body
        channel.withdraw(power_api(NS, OPERATOR), node)
        return False

    _wait("the admission policy to take effect", refused, timeout=15)
    assert channel.fetch(editor, node) is None  # reading stays allowed by the wildcard role
    channel.publish(power_api(NS, OPERATOR), _targets(node, set()))
    channel.withdraw(power_api(NS, OPERATOR), node)


def test_unreachable_api_server_fails_fast_as_a_source_error() -> None:
    from kubernetes.client import Configuration

    config = Configuration(host=f"https://127.0.0.1:{_free_port()}")
    config.retries = 0
    source = channel.KubeTargetSource(client.ApiClient(config), "any", timeout_s=2)
    started = time.monotonic()
    with pytest.raises(channel.SourceError, match="unreachable"):
        source.fetch()
    assert time.monotonic() - started < 3


def test_republishing_replaces_the_whole_target(power_api) -> None:
    operator, node = power_api(NS, OPERATOR), _node()
    boosted = _targets(node, {1})
    channel.publish(operator, replace(boosted, ramp_step_w=10))
    channel.publish(operator, _targets(node, set()))
    spec = channel.fetch(operator, node)["spec"]
    assert spec["gpus"] == [] and "rampStepWatts" not in spec
    channel.withdraw(operator, node)


def test_publish_all_writes_a_racks_shares_within_its_budget(power_api) -> None:
    operator, nodes = power_api(NS, OPERATOR), {_node(): 4, _node(): 4}
    policy = PowerPolicy(base_w=500, rack_budget_w=4300)
    first = next(iter(nodes))
    targets = plan_rack(policy, "rack-b", nodes, {(first, 0)}, 1.3, datetime.now(UTC))
    channel.publish_all(operator, targets)
    budgets = {n: channel.fetch(operator, n)["spec"]["budgetWatts"] for n in nodes}
    assert budgets == {n: t.budget_w for n, t in targets.items()}
    assert sum(budgets.values()) <= 4300
    for n in nodes:
        channel.withdraw(operator, n)


@pytest.mark.parametrize(
    ("field", "value"),
    [("budgetWatts", 5000), ("baseWatts", 9000), ("gpus", [{"index": 99, "watts": 600}]),
     ("ttlSeconds", 0)],
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class AgentProcess:
    """`tessera power-agent --backend sim` as the agent's service account."""

    def __init__(self, control_plane, tmp: Path, node: str) -> None:
        token = control_plane.service_account_token(NS, AGENT)
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
        return [sys.executable, "-m", "tessera_operator.cli", "power-agent", "--node", self.node,
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


@pytest.fixture
def agent(control_plane, power_api, tmp_path: Path) -> Iterator[AgentProcess]:
    a = AgentProcess(control_plane, tmp_path, _node())
    yield a
    if a.proc and a.proc.poll() is None:
        a.proc.kill()
        a.proc.wait()
    a.proxy.close()
    channel.withdraw(power_api(NS, OPERATOR), a.node)


def test_boost_release_and_sigterm_restore_through_the_api(agent: AgentProcess, power_api) -> None:
    operator = power_api(NS, OPERATOR)
    channel.publish(operator, _targets(agent.node, set()))
    agent.start()
    _wait("base cap", lambda: agent.gpus.limits_mw() == [500 * W] * 8)
    base_clock = agent.gpus.read(0).sm_clock_mhz

    # GPU 5 fails: the operator boosts the 7 survivors for TP 8 -> 7, paid by GPU 5's budget.
    degraded = _targets(agent.node, {5})
    channel.publish(operator, degraded)
    boost = degraded.gpu_w[0] * W
    _wait("boost", lambda: agent.gpus.limits_mw() == [boost] * 5 + [200 * W] + [boost] * 2)
    assert sum(agent.gpus.limits_mw()) <= _policy().rack_budget_w * W
    # Each survivor does 8/7 of a healthy GPU's work, at the speed its SM clock allows: the
    # reduced replica keeps pace if the clock rose by 8/7, less the whole-watt boost (<= 1 W,
    # ~0.15% of speed at this slope) and the whole-MHz clock (~0.07%).
    assert agent.gpus.read(0).sm_clock_mhz / base_clock >= 8 / 7 * (1 - 0.003)
    text = agent.metrics()
    assert f'tessera_gpu_power_boosted{{gpu="0",node="{agent.node}"' in text
    assert f'tessera_gpu_power_target_watts{{gpu="0",node="{agent.node}"' in text

    # The GPU is back: release to the base cap.
    channel.publish(operator, _targets(agent.node, set()))
    _wait("release", lambda: agent.gpus.limits_mw() == [500 * W] * 8)

    # GPU 7 falls off the bus just before the node is drained: the others are still restored.
    lost = agent.gpus.gpus()[7].uuid
    agent.gpus.inject(7, "gpu_lost")
    started = time.monotonic()
    code, out = agent.stop(signal.SIGTERM)
    assert code == 1 and "could not restore 1 GPU(s)" in out, out
    assert time.monotonic() - started < 10  # well inside the DaemonSet's 30 s grace period
    assert agent.gpus.limits_mw() == [700 * W] * 7 + [500 * W]  # the default limits
    assert list(agent.managed()) == [lost]  # for the next agent


def test_crashed_agent_is_undone_by_the_next_one(agent: AgentProcess, power_api) -> None:
    operator = power_api(NS, OPERATOR)
    degraded = _targets(agent.node, {2})
    channel.publish(operator, degraded)
    agent.start()
    # Wait for every GPU to reach its target: the sim GPUs start at their 700 W default, above
    # the boost, so "above the base cap" alone would hold before the agent touched them.
    _wait("boost", lambda: agent.gpus.limits_mw() == [degraded.watts_for(i) * W
                                                       for i in range(8)])
    agent.stop(signal.SIGKILL)
    assert agent.gpus.limits_mw()[2] == 200 * W  # nobody restored anything
    assert len(agent.managed()) == 8

    channel.withdraw(operator, agent.node)  # the node released: the new agent restores
    agent.start()
    _wait("restore by the next agent", lambda: agent.gpus.limits_mw() == [700 * W] * 8)
    _wait("state cleared", lambda: agent.managed() == {})
    code, out = agent.stop(signal.SIGTERM)
    assert code == 0, out


def test_rolling_update_hands_the_boost_over_and_a_second_agent_is_refused(
    agent: AgentProcess, power_api
) -> None:
    operator = power_api(NS, OPERATOR)
    degraded = _targets(agent.node, {2})
    boosted = [degraded.watts_for(i) * W for i in range(8)]
    channel.publish(operator, degraded)
    agent.start("--on-exit", "hold")
    _wait("boost", lambda: agent.gpus.limits_mw() == boosted)

    second = subprocess.run(agent.command("--metrics-port", "0"), capture_output=True, text=True,
                            timeout=30)
    assert second.returncode == 2 and "locked by another power agent" in second.stderr
    assert agent.proc.poll() is None and agent.gpus.limits_mw() == boosted

    code, out = agent.stop(signal.SIGTERM)  # --on-exit hold: nothing restored
    assert code == 0, out
    assert agent.gpus.limits_mw() == boosted and len(agent.managed()) == 8
    channel.publish(operator, replace(degraded, renew_time=datetime.now(UTC)))
    agent.start()
    _wait("adopted", lambda: _sample(agent.metrics(), "tessera_power_agent_holding") == 0.0)
    assert agent.gpus.limits_mw() == boosted  # never back to the 700 W defaults in between
    code, out = agent.stop(signal.SIGTERM)
    assert code == 0 and "adopting 8 GPU(s)" in out, out
    assert agent.gpus.limits_mw() == [700 * W] * 8


def _sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_agent_rides_out_an_api_server_outage(agent: AgentProcess, power_api) -> None:
    operator = power_api(NS, OPERATOR)
    agent.start()
    degraded = replace(_targets(agent.node, {5}), ttl_s=8)
    channel.publish(operator, degraded)
    boosted = [degraded.watts_for(i) * W for i in range(8)]
    _wait("boost", lambda: agent.gpus.limits_mw() == boosted)

    # The API server black-holes: every call must time out, the loop keep going, the boost hold.
    agent.proxy.cut()
    _wait("errors counted", lambda: (_sample(agent.metrics(), "tessera_power_agent_errors_total",
                                             kind="SourceError") or 0) >= 2)
    _wait("stale target held", lambda: _sample(
        agent.metrics(), "tessera_power_agent_holding") == 1.0, timeout=15)
    assert agent.gpus.limits_mw() == boosted

    # Back online: the agent picks up the operator's release.
    channel.publish(operator, _targets(agent.node, set()))
    agent.proxy.mend()
    _wait("release after the outage", lambda: agent.gpus.limits_mw()[:5] == [500 * W] * 5)

    # Shutdown during an outage is not delayed by it: no API call on the way out.
    agent.proxy.cut()
    started = time.monotonic()
    code, out = agent.stop(signal.SIGTERM)
    assert code == 0, out
    assert time.monotonic() - started < 10
    assert agent.gpus.limits_mw() == [700 * W] * 8
    assert "SourceError" in out or "unreachable" in out
