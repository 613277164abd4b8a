"""A pod's volumes as host directories the containers bind-mount, and their service-account tokens.

Each volume is a directory under the pod's own folder (hostPath: under the node's root folder),
filled as the kubelet fills it: ConfigMap and Secret keys, downward API fields, projected sources
with TokenRequest tokens bound to the pod. Tokens are refreshed at 80% of their lifetime.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera_dev.simnode.podspec import NotYetAvailable, PodSpecError, field_value

SUPPORTED = ("emptyDir", "hostPath", "configMap", "secret", "downwardAPI", "projected")
DEFAULT_MODE = 0o644
TOKEN_REFRESH_FRACTION = 0.8  # as the kubelet's token manager

# (kind, namespace, name) -> the object's data, or None when it does not exist
ObjectReader = Callable[[str, str, str], Mapping[str, bytes] | None]
# (service account, audience or None, seconds) -> (token, lifetime in seconds)
TokenIssuer = Callable[[str, str | None, int], tuple[str, float]]


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace path so a reader sees the old or the new content, never a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def volume_kind(volume: Mapping[str, Any]) -> str:
    """The volume's source type: the one key besides its name."""
    kinds = [key for key in volume if key != "name"]
    return kinds[0] if len(kinds) == 1 else ",".join(sorted(kinds)) or "none"


def check_volumes(pod: Mapping[str, Any]) -> None:
    """Refuse the pod before anything runs if one of its volumes is of an unsupported type."""
    for volume in pod["spec"].get("volumes") or []:
        kind = volume_kind(volume)
        if kind not in SUPPORTED:
            raise PodSpecError(
                "UnsupportedVolume",
                f"volume {volume['name']!r} is of type {kind!r}, which the simulated node "
                f"does not support (supported: {', '.join(SUPPORTED)})")


@dataclass
class _Token:
    path: Path
    account: str
    audience: str | None
    seconds: int
    mode: int
    refresh_at: float = 0.0


class PodVolumes:
    """The volumes of one pod: `prepare()` fills them, `refresh()` keeps tokens current."""

    def __init__(self, pod: Mapping[str, Any], pod_dir: Path, host_root: Path, *,
                 read_object: ObjectReader, issue_token: TokenIssuer, pod_ip: str,
                 host_ip: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._pod = pod
        self._dir = pod_dir / "volumes"
        self._host_root = host_root
        self._read = read_object
        self._issue = issue_token
        self._ips = {"pod_ip": pod_ip, "host_ip": host_ip}
        self._clock = clock
        self._tokens: list[_Token] = []
        self.paths: dict[str, Path] = {}

    @property
    def _namespace(self) -> str:
        return self._pod["metadata"]["namespace"]

    def prepare(self) -> dict[str, Path]:
        """Create and fill every volume; returns volume name -> host path to bind."""
        check_volumes(self._pod)
        self._tokens.clear()
        for volume in self._pod["spec"].get("volumes") or []:
            kind, name = volume_kind(volume), volume["name"]
            source = volume[kind] or {}
            if kind == "hostPath":
                self.paths[name] = self._host_path(name, source)
                continue
            target = self._dir / name
            target.mkdir(parents=True, exist_ok=True)
            if kind in ("configMap", "secret"):
                self._object_files(target, kind, source, source.get("defaultMode", DEFAULT_MODE))
            elif kind == "downwardAPI":
                self._downward_files(target, source, source.get("defaultMode", DEFAULT_MODE))
            elif kind == "projected":
                self._projected(target, source)
            self.paths[name] = target
        self.refresh()
        return self.paths

    @property
    def due(self) -> float:
        """When the next token needs renewing (inf without tokens)."""
        return min((t.refresh_at for t in self._tokens), default=float("inf"))

    def refresh(self) -> float:
        """Renew the tokens that reached 80% of their life; returns when the next one is due."""
        now = self._clock()
        for token in self._tokens:
            if now >= token.refresh_at:
                value, lifetime = self._issue(token.account, token.audience, token.seconds)
                write_atomic(token.path, value.encode(), token.mode)
                token.refresh_at = now + TOKEN_REFRESH_FRACTION * lifetime
        return self.due

    # -- sources

    def _host_path(self, name: str, source: Mapping[str, Any]) -> Path:
        path = self._host_root / source["path"].lstrip("/")
        kind = source.get("type") or ""
        if kind == "DirectoryOrCreate" or (kind == "" and not path.exists()):
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            if not path.parent.is_dir():
                raise NotYetAvailable("FailedMount", f"volume {name!r}: hostPath "
                                      f"{source['path']!r}: its parent directory does not exist")
            path.touch(exist_ok=True)
        checks = {"Directory": stat.S_ISDIR, "DirectoryOrCreate": stat.S_ISDIR,
                  "File": stat.S_ISREG, "FileOrCreate": stat.S_ISREG, "Socket": stat.S_ISSOCK,
                  "CharDevice": stat.S_ISCHR, "BlockDevice": stat.S_ISBLK}
        if kind and kind in checks:
            try:
                ok = checks[kind](path.stat().st_mode)
            except FileNotFoundError:
                ok = False
            if not ok:
                raise NotYetAvailable("FailedMount", f"volume {name!r}: hostPath "
                                      f"{source['path']!r} is not a {kind} (under {path})")
        elif kind:
            raise PodSpecError("UnsupportedVolume",
                               f"volume {name!r}: unknown hostPath type {kind!r}")
        return path

    def _object_files(self, target: Path, kind: str, source: Mapping[str, Any],
                      default_mode: int) -> None:
        name = source.get("name") or source.get("secretName", "")
        data = self._read(kind.lower(), self._namespace, name)
        if data is None:
            if source.get("optional"):
                return
            raise NotYetAvailable("FailedMount",
                                  f"{kind} {self._namespace}/{name} not found")
        items = source.get("items") or [{"key": key, "path": key} for key in data]
        for item in items:
            if item["key"] not in data:
                if source.get("optional"):
                    continue
                raise NotYetAvailable("FailedMount", f"{kind} {self._namespace}/{name} has no "
                                      f"key {item['key']!r}")
            write_atomic(target / item["path"], data[item["key"]],
                         item.get("mode", default_mode))

    def _downward_files(self, target: Path, source: Mapping[str, Any],
                        default_mode: int) -> None:
        for item in source.get("items") or []:
            if "fieldRef" not in item:
                raise PodSpecError("UnsupportedVolume", f"downwardAPI item {item['path']!r}: "
                                   "only fieldRef is supported by the simulated node")
            value = field_value(self._pod, item["fieldRef"]["fieldPath"], **self._ips)
            write_atomic(target / item["path"], value.encode(), item.get("mode", default_mode))

    def _projected(self, target: Path, source: Mapping[str, Any]) -> None:
        mode = source.get("defaultMode", DEFAULT_MODE)
        account = self._pod["spec"].get("serviceAccountName") or "default"
        for part in source.get("sources") or []:
            if "serviceAccountToken" in part:
                token = part["serviceAccountToken"]
                self._tokens.append(_Token(target / token["path"], account,
                                           token.get("audience"),
                                           int(token.get("expirationSeconds", 3600)), mode))
            elif "configMap" in part:
                self._object_files(target, "configMap", part["configMap"], mode)
            elif "secret" in part:
                self._object_files(target, "secret", part["secret"], mode)
            elif "downwardAPI" in part:
                self._downward_files(target, part["downwardAPI"], mode)
            else:
                raise PodSpecError("UnsupportedVolume", f"projected source {sorted(part)} is "
                                   "not supported by the simulated node")
