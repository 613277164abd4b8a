"""The simulated kubelet's pure rules: $(VAR) expansion, env order, argv, back-off, phase."""

from __future__ import annotations

import pytest

from tessera_dev.simnode import images, podspec
from tessera_dev.simnode.podspec import NotYetAvailable, Outcome, PodSpecError

pytestmark = pytest.mark.cluster

POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"b": "2", "a": "1"}},
       "spec": {"nodeName": "n1", "serviceAccountName": "sa"}}


def lookup(kind: str, name: str, optional: bool) -> dict[str, str] | None:
    objects = {("configmap", "cm"): {"K": "from-cm", "X": "x"}, ("secret", "s"): {"K": "sec"}}
    data = objects.get((kind, name))
    if data is None and not optional:
        raise NotYetAvailable("CreateContainerConfigError", f"{kind} {name} not found")
    return data


def test_expansion_follows_kubernetes() -> None:
    env = {"A": "1", "B": "two"}
    assert podspec.expand("$(A)-$(B)", env) == "1-two"
    assert podspec.expand("$(MISSING) $$(A) $$", env) == "$(MISSING) $(A) $"


def test_env_order_sources_and_references() -> None:
    container = {"name": "c", "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
                 "env": [
                     {"name": "ONE", "value": "1"},
                     {"name": "TWO", "value": "$(ONE)+$(LATER)"},  # LATER is not defined yet
                     {"name": "LATER", "value": "l"},
                     {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                     {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                     {"name": "LBL", "valueFrom": {"fieldRef": {
                         "fieldPath": "metadata.labels['a']"}}},
                     {"name": "SEC", "valueFrom": {"secretKeyRef": {"name": "s", "key": "K"}}},
                     {"name": "OPT", "valueFrom": {"configMapKeyRef": {
                         "name": "absent", "key": "K", "optional": True}}},
                     {"name": "PATH", "value": "/x:$(PATH)"},
                 ]}
    env = podspec.container_env(POD, container, base={"PATH": "/bin"}, pod_ip="127.1.0.2",
                                host_ip="127.1.0.1", lookup=lookup)
    assert env == {"PATH": "/x:/bin", "CM_K": "from-cm", "CM_X": "x", "ONE": "1",
                   "TWO": "1+$(LATER)", "LATER": "l", "POD": "p", "IP": "127.1.0.2",
                   "LBL": "1", "SEC": "sec"}


def test_missing_references_wait_and_unsupported_sources_fail() -> None:
    missing = {"name": "c", "env": [{"name": "V", "valueFrom": {
        "configMapKeyRef": {"name": "cm", "key": "NOPE"}}}]}
    with pytest.raises(NotYetAvailable, match="NOPE"):
        podspec.container_env(POD, missing, base={}, pod_ip="", host_ip="", lookup=lookup)
    resource = {"name": "c", "env": [{"name": "V", "valueFrom": {
        "resourceFieldRef": {"resource": "limits.cpu"}}}]}
    with pytest.raises(PodSpecError, match="resourceFieldRef") as err:
        podspec.container_env(POD, resource, base={}, pod_ip="", host_ip="", lookup=lookup)
    assert err.value.reason == "UnsupportedEnvSource"


def test_downward_labels_file_format() -> None:
    assert podspec.field_value(POD, "metadata.labels", pod_ip="", host_ip="") == \
        'a="1"\nb="2"\n'


def test_argv_uses_the_known_entrypoint_or_refuses() -> None:
    env = {"N": "n1"}
    assert podspec.container_argv({"name": "c", "image": "ghcr.io/x/tessera-power-agent:0.1",
                                   "args": ["--node", "$(N)"]}, env) == \
        ["tessera", "power-agent", "--node", "n1"]
    assert podspec.container_argv({"name": "c", "image": "busybox", "command": ["sh"],
                                   "args": ["-c", "echo $(N)"]}, env) == ["sh", "-c", "echo n1"]
    with pytest.raises(PodSpecError, match="busybox") as err:
        podspec.container_argv({"name": "c", "image": "busybox"}, env)
    assert err.value.reason == "UnknownImage"
    assert images.repository("reg:5000/a/tessera:1@sha256:ab") == "tessera"


def test_restart_policy_and_backoff() -> None:
    assert podspec.restarts("Always", 0) and podspec.restarts("OnFailure", 1)
    assert not podspec.restarts("OnFailure", 0) and not podspec.restarts("Never", 1)
    # kubelet: the first restart is immediate, then 10 s doubling, capped at 5 min
    assert [podspec.restart_delay(n) for n in range(1, 8)] == [0, 10, 20, 40, 80, 160, 300]


def test_phase() -> None:
    run = Outcome(started=True, running=True, exit_code=None, will_restart=False)
    ok = Outcome(started=True, running=False, exit_code=0, will_restart=False)
    bad = Outcome(started=True, running=False, exit_code=2, will_restart=False)
    waiting = Outcome(started=False, running=False, exit_code=None, will_restart=True)
    assert podspec.phase(False, False, [waiting]) == "Pending"
    assert podspec.phase(True, True, [waiting]) == "Failed"
    assert podspec.phase(True, False, [waiting]) == "Pending"
    assert podspec.phase(True, False, [run, ok]) == "Running"
    assert podspec.phase(True, False, [ok, ok]) == "Succeeded"
    assert podspec.phase(True, False, [ok, bad]) == "Failed"


def test_conditions_keep_transition_times() -> None:
    first = podspec.conditions([], {"Ready": False}, "t0")
    same = podspec.conditions(first, {"Ready": False}, "t1")
    flipped = podspec.conditions(same, {"Ready": True}, "t2")
    assert same[0]["lastTransitionTime"] == "t0"
    assert flipped[0]["lastTransitionTime"] == "t2"
    kept = podspec.conditions([{"type": "PodScheduled", "status": "True"}], {"Ready": True}, "t")
    assert {c["type"] for c in kept} == {"PodScheduled", "Ready"}
