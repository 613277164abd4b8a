"""A pod's volumes as host directories the containers bind-mount, and their service-account tokens.

Each volume is a directory under the pod's own folder (hostPath: under the node's root folder),
filled as the kubelet fills it: ConfigMap and Secret keys, downward API fields, projected sources
with TokenRequest tokens bound to the pod. Tokens are refreshed at 80% of their lifetime.

An `emptyDir` with `medium: Memory` (a training pod's /dev/shm) lives on a tmpfs: the pod's folder
under the node's folder in the host's /dev/shm (`memory_root`), when that is a writable tmpfs; else
it is a plain directory like any emptyDir. Both go with the pod.

A `persistentVolumeClaim` is served from the PersistentVolume the claim is bound to; until the
claim exists and is Bound the pod waits (NotYetAvailable). PersistentVolume sources:

- `nfs: {server, path}`: NFS_ROOT/SERVER/PATH, NFS_ROOT being the one folder every node of a local
  cluster is given (`sim-node --nfs-dir`), so all its nodes share the files; an export is created
  on its first mount;
- `hostPath` (with its `type`) and `local` (an existing directory): under the node's root folder,
  as hostPath volumes.

The claim's `readOnly` (or the NFS source's) mounts the volume read-only in every container.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tessera_dev.simnode.podspec import NotYetAvailable, PodSpecError, field_value
from tessera_kube.files import write_atomic

SUPPORTED = ("emptyDir", "hostPath", "configMap", "secret", "downwardAPI", "projected",
             "persistentVolumeClaim")
PV_SOURCES = ("nfs", "hostPath", "local")
EMPTY_DIR_MEDIA = ("", "Memory")
# what a PersistentVolume's spec holds besides its one volume source
PV_SPEC_FIELDS = frozenset({
    "accessModes", "capacity", "claimRef", "mountOptions", "nodeAffinity",
    "persistentVolumeReclaimPolicy", "storageClassName", "volumeAttributesClassName",
    "volumeMode"})
SHM = Path("/dev/shm")
DEFAULT_MODE = 0o644
TOKEN_REFRESH_FRACTION = 0.8  # as the kubelet's token manager

# (kind, namespace, name) -> the object's data, or None when it does not exist
ObjectReader = Callable[[str, str, str], Mapping[str, bytes] | None]
# ("persistentvolumeclaim", namespace, name) or ("persistentvolume", "", name) -> the object, or
# None when it does not exist
StorageReader = Callable[[str, str, str], Mapping[str, Any] | None]
# (service account, audience or None, seconds) -> (token, lifetime in seconds)
TokenIssuer = Callable[[str, str | None, int], tuple[str, float]]


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
        medium = (volume[kind] or {}).get("medium") or ""
        if kind == "emptyDir" and medium not in EMPTY_DIR_MEDIA:
            raise PodSpecError(
                "UnsupportedVolume",
                f"volume {volume['name']!r}: emptyDir medium {medium!r} is not supported by the "
                "simulated node (supported: the node's disk, or Memory)")


def bound_volume(claim: Mapping[str, Any], what: str) -> str:
    """The name of the PersistentVolume `claim` is bound to; NotYetAvailable until it is."""
    if claim["metadata"].get("deletionTimestamp"):
        raise NotYetAvailable("FailedMount", f"{what} is being deleted")
    phase = (claim.get("status") or {}).get("phase") or "Pending"
    volume = claim["spec"].get("volumeName")
    if phase != "Bound" or not volume:
        raise NotYetAvailable("FailedMount", f"{what} is not bound to a PersistentVolume yet "
                              f"(phase {phase})")
    return volume


def volume_source(pv: Mapping[str, Any], claim: Mapping[str, Any],
                  what: str) -> tuple[str, Mapping[str, Any]]:
    """The source of the PersistentVolume `claim` is bound to, as (kind, fields)."""
    name, ref = pv["metadata"]["name"], pv["spec"].get("claimRef") or {}
    meta = claim["metadata"]
    if (ref.get("namespace"), ref.get("name"), ref.get("uid")) != (
            meta["namespace"], meta["name"], meta["uid"]):
        raise NotYetAvailable("FailedMount", f"{what}: PersistentVolume {name} is not bound "
                              "to it")
    kinds = sorted(set(pv["spec"]) - PV_SPEC_FIELDS)
    if len(kinds) != 1 or kinds[0] not in PV_SOURCES:
        raise PodSpecError(
            "UnsupportedVolume",
            f"{what}: PersistentVolume {name} has source {','.join(kinds) or 'none'}, which the "
            f"simulated node does not support (supported: {', '.join(PV_SOURCES)})")
    return kinds[0], pv["spec"][kinds[0]] or {}


def nfs_export(root: Path, server: str, path: str) -> Path:
    """The folder that plays NFS export server:path, under the cluster's NFS root."""
    parts = PurePosixPath(path).parts
    if not server or "/" in server or server in (".", "..") or not path.startswith("/") \
            or ".." in parts:
        raise PodSpecError("UnsupportedVolume", f"NFS export {server}:{path}: the server must "
                           "be a host name and the path absolute, without '..'")
    return root / server / PurePosixPath(*parts[1:])


def memory_root(node_dir: Path) -> Path:
    """The folder in the host's /dev/shm that holds the Memory emptyDirs of the node whose state
    is in node_dir (named after it, so whoever stops the node can remove what it leaves)."""
    digest = hashlib.sha256(str(node_dir.resolve()).encode()).hexdigest()[:12]
    return SHM / f"tessera-sim-{node_dir.name}-{digest}"


def writable_tmpfs(path: Path) -> bool:
    """Whether a tmpfs is mounted at path and this process may write to it."""
    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        return False
    # the last mount on a path is the one that shows there
    types = [fields[2] for fields in map(str.split, mounts.splitlines())
             if len(fields) > 2 and fields[1] == str(path)]
    return bool(types) and types[-1] == "tmpfs" and os.access(path, os.W_OK)


@dataclass
class _Token:
    path: Path
    account: str
    audience: str | None
    seconds: int
    mode: int
    refresh_at: float = 0.0


class PodVolumes:
    """The volumes of one pod: `prepare()` fills them, `refresh()` keeps tokens current.

    `memory_dir` is the pod's folder on a tmpfs for Memory emptyDirs (None: the node has no
    tmpfs, they are plain directories); `nfs_root` the folder of the cluster's NFS exports
    (None: the node serves no NFS volumes)."""

    def __init__(self, pod: Mapping[str, Any], pod_dir: Path, host_root: Path, *,
                 read_object: ObjectReader, read_storage: StorageReader,
                 issue_token: TokenIssuer, pod_ip: str, host_ip: str,
                 memory_dir: Path | None = None, nfs_root: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pod = pod
        self._dir = pod_dir / "volumes"
        self._host_root = host_root
        self._read = read_object
        self._read_storage = read_storage
        self._issue = issue_token
        self._ips = {"pod_ip": pod_ip, "host_ip": host_ip}
        self._memory = memory_dir
        self._nfs_root = nfs_root
        self._clock = clock
        self._tokens: list[_Token] = []
        self.paths: dict[str, Path] = {}
        self.read_only: set[str] = set()  # volumes every container mounts read-only

    @property
    def _namespace(self) -> str:
        return self._pod["metadata"]["namespace"]

    def prepare(self) -> dict[str, Path]:
        """Create and fill every volume; returns volume name -> host path to bind."""
        check_volumes(self._pod)
        self._tokens.clear()
        self.read_only.clear()
        for volume in self._pod["spec"].get("volumes") or []:
            kind, name = volume_kind(volume), volume["name"]
            source = volume[kind] or {}
            if kind == "hostPath":
                self.paths[name] = self._host_path(name, source)
                continue
            if kind == "persistentVolumeClaim":
                self.paths[name] = self._claim(name, source)
                continue
            in_memory = kind == "emptyDir" and source.get("medium") == "Memory"
            target = (self._memory if in_memory and self._memory else self._dir) / name
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

    def _claim(self, name: str, source: Mapping[str, Any]) -> Path:
        claim_name = source["claimName"]
        what = f"volume {name!r}: persistentVolumeClaim {self._namespace}/{claim_name}"
        claim = self._read_storage("persistentvolumeclaim", self._namespace, claim_name)
        if claim is None:
            raise NotYetAvailable("FailedMount", f"{what} not found")
        pv_name = bound_volume(claim, what)
        pv = self._read_storage("persistentvolume", "", pv_name)
        if pv is None:
            raise NotYetAvailable("FailedMount", f"{what}: PersistentVolume {pv_name} not found")
        kind, pv_source = volume_source(pv, claim, what)
        if source.get("readOnly") or pv_source.get("readOnly"):
            self.read_only.add(name)
        if kind == "hostPath":
            return self._host_path(name, pv_source, f"PersistentVolume {pv_name} hostPath")
        if kind == "local":
            return self._host_path(name, {"path": pv_source["path"], "type": "Directory"},
                                   f"PersistentVolume {pv_name} local path")
        if self._nfs_root is None:
            raise PodSpecError("UnsupportedVolume", f"{what}: PersistentVolume {pv_name} is "
                               "NFS, and this node was started without --nfs-dir")
        export = nfs_export(self._nfs_root, pv_source.get("server", ""),
                            pv_source.get("path", ""))
        export.mkdir(parents=True, exist_ok=True)
        return export

    def _host_path(self, name: str, source: Mapping[str, Any], what: str = "hostPath") -> Path:
        path = self._host_root / source["path"].lstrip("/")
        kind = source.get("type") or ""
        if kind == "DirectoryOrCreate" or (kind == "" and not path.exists()):
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            if not path.parent.is_dir():
                raise NotYetAvailable("FailedMount", f"volume {name!r}: {what} "
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
                raise NotYetAvailable("FailedMount", f"volume {name!r}: {what} "
                                      f"{source['path']!r} is not a {kind} (under {path})")
        elif kind:
            raise PodSpecError("UnsupportedVolume",
                               f"volume {name!r}: unknown {what} type {kind!r}")
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
