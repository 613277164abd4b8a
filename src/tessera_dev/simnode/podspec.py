"""A kubelet's rules as pure functions: env, $(VAR) expansion, field references, argv, restarts.

No I/O here: ConfigMap and Secret contents come in through a `Lookup`, time as arguments, so the
node process and the unit tests share the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tessera_dev.simnode import images

# kubelet's container restart back-off: the first restart is immediate, then 10 s doubling to
# 5 min; a container that ran for twice the cap starts over
BACKOFF_BASE_S = 10.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_S = 2 * BACKOFF_MAX_S

# (kind, name, optional) -> the object's data decoded to text; None when optional and absent
Lookup = Callable[[str, str, bool], Mapping[str, str] | None]


class PodSpecError(Exception):
    """The pod cannot run on this node as written: it fails with this reason and message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class NotYetAvailable(Exception):
    """Something the pod references does not exist (yet): the node retries and says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][-._A-Za-z0-9]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, `$$` escapes, others stay."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _VAR.sub(replace, text)


_SUBSCRIPT = re.compile(r"metadata\.(labels|annotations)\['([^']*)'\]")


def _key_values(values: Mapping[str, str]) -> str:
    # the downward API's file format for a whole map: one key="value" per line, sorted
    return "".join(f'{key}="{value}"\n' for key, value in sorted(values.items()))


def field_value(pod: Mapping[str, Any], path: str, *, pod_ip: str, host_ip: str) -> str:
    """The value of a downward API `fieldRef.fieldPath` for this pod."""
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    if path in ("metadata.labels", "metadata.annotations"):
        return _key_values(meta.get(path.split(".")[1]) or {})
    match = _SUBSCRIPT.fullmatch(path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    raise PodSpecError("UnsupportedFieldRef", f"fieldRef {path!r} is not supported")


def _ref_kind(source: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    for field, kind in (("configMapKeyRef", "configmap"), ("secretKeyRef", "secret"),
                        ("configMapRef", "configmap"), ("secretRef", "secret")):
        if field in source:
            return kind, source[field]
    raise PodSpecError("UnsupportedEnvSource", f"env source {sorted(source)} is not supported")


def _value_from(pod: Mapping[str, Any], container: str, var: Mapping[str, Any], *,
                pod_ip: str, host_ip: str, lookup: Lookup) -> str | None:
    source = var["valueFrom"]
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip=host_ip)
    if "resourceFieldRef" in source:
        raise PodSpecError(
            "UnsupportedEnvSource",
            f"container {container!r} env {var['name']!r}: resourceFieldRef is not supported by "
            "the simulated node (containers have no resource limits enforced here)")
    kind, ref = _ref_kind(source)
    optional = bool(ref.get("optional", False))
    data = lookup(kind, ref["name"], optional)
    if data is None:
        return None
    if ref["key"] not in data:
        if optional:
            return None
        raise NotYetAvailable(
            "CreateContainerConfigError",
            f"couldn't find key {ref['key']} in {kind} {pod['metadata']['namespace']}/"
            f"{ref['name']}")
    return data[ref["key"]]


def container_env(pod: Mapping[str, Any], container: Mapping[str, Any], *,
                  base: Mapping[str, str], pod_ip: str, host_ip: str,
                  lookup: Lookup) -> dict[str, str]:
    """The container's environment: `base`, then envFrom, then env in order (later wins).

    `$(VAR)` in a value refers to what is defined before it, as in Kubernetes.
    """
    env = dict(base)
    for source in container.get("envFrom") or []:
        kind, ref = _ref_kind(source)
        data = lookup(kind, ref["name"], bool(ref.get("optional", False))) or {}
        env.update({source.get("prefix", "") + key: value for key, value in data.items()})
    for var in container.get("env") or []:
        if "valueFrom" in var:
            value = _value_from(pod, container["name"], var, pod_ip=pod_ip, host_ip=host_ip,
                                lookup=lookup)
            if value is not None:
                env[var["name"]] = value
        else:
            env[var["name"]] = expand(var.get("value", ""), env)
    return env


def unpullable(container: Mapping[str, Any]) -> str | None:
    """Why the node cannot run `container`'s image, as a kubelet cannot pull one: it has no
    command and is not one of this project's images (or their stand-ins), so its entrypoint
    is unknown; None when it can."""
    image = container.get("image", "")
    if container.get("command") or images.entrypoint(image) is not None:
        return None
    return (f"container {container['name']!r} has no command and its image {image!r} is not "
            f"one of this project's images ({', '.join(sorted(images.ENTRYPOINTS))}): the "
            "simulated node does not pull images, so it cannot know the entrypoint")


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded; no command runs the image's known entrypoint."""
    why = unpullable(container)
    if why is not None:
        raise PodSpecError("UnknownImage", why)
    command = list(container.get("command") or []) or list(
        images.entrypoint(container.get("image", "")) or ())
    return [expand(arg, env) for arg in command + list(container.get("args") or [])]


def gpu_request(container: Mapping[str, Any], resource: str = "nvidia.com/gpu") -> int:
    """How many GPUs the container asks for (extended resources are set in limits)."""
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(resource) \
        or (resources.get("requests") or {}).get(resource) or 0
    return int(value)


def restarts(policy: str, exit_code: int) -> bool:
    """Whether a container that exited with exit_code runs again under the pod's restartPolicy."""
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def restart_delay(crashes: int) -> float:
    """Seconds before the next start after the `crashes`-th consecutive crash (1-based)."""
    return 0.0 if crashes <= 1 else min(BACKOFF_BASE_S * 2 ** (crashes - 2), BACKOFF_MAX_S)


@dataclass(frozen=True)
class Outcome:
    """Where one app container stands, for the pod phase."""

    started: bool  # ran at least once
    running: bool
    exit_code: int | None  # of its last run, when it is not running
    will_restart: bool


def phase(initialized: bool, init_failed: bool, outcomes: Iterable[Outcome]) -> str:
    """The pod phase from its containers, as the kubelet computes it."""
    if init_failed:
        return "Failed"
    views = list(outcomes)
    if not initialized or not views:
        return "Pending"
    if any(v.running or v.will_restart for v in views):
        return "Running" if any(v.started for v in views) else "Pending"
    return "Succeeded" if all(v.exit_code == 0 for v in views) else "Failed"


def exit_reason(exit_code: int) -> str:
    return "Completed" if exit_code == 0 else "Error"


def conditions(previous: Iterable[Mapping[str, Any]], wanted: Mapping[str, bool],
               now: str) -> list[dict[str, Any]]:
    """Pod conditions with the given truth values; lastTransitionTime moves only on a change.

    Conditions set by others (the scheduler's PodScheduled, a disruption target) are kept.
    """
    before = {c["type"]: c for c in previous}
    result = [dict(c) for t, c in before.items() if t not in wanted]
    for kind, value in wanted.items():
        status = "True" if value else "False"
        old = before.get(kind)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else now
        result.append({"type": kind, "status": status, "lastProbeTime": None,
                       "lastTransitionTime": since or now})
    return result
