"""Pod volumes as the kubelet fills them: keys and modes, projections, token renewal, claims
bound to shared and node-local PersistentVolumes, memory-backed emptyDirs, refusals."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tessera_dev.simnode.podspec import NotYetAvailable, PodSpecError
from tessera_dev.simnode.volumes import (
    TOKEN_REFRESH_FRACTION,
    PodVolumes,
    check_volumes,
    writable_tmpfs,
)

pytestmark = pytest.mark.cluster

OBJECTS = {("configmap", "settings"): {"a.yaml": b"a: 1\n", "b": b"bee"},
           ("configmap", "kube-root-ca.crt"): {"ca.crt": b"CA"},
           ("secret", "creds"): {"password": b"pw"}}


def pod(volumes: list[dict]) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
            "spec": {"serviceAccountName": "runner", "volumes": volumes}}


class Issuer:
    """TokenRequest stand-in: numbered tokens with a fixed lifetime."""

    def __init__(self, lifetime: float) -> None:
        self.lifetime = lifetime
        self.calls: list[tuple[str, str | None, int]] = []

    def __call__(self, account: str, audience: str | None, seconds: int) -> tuple[str, float]:
        self.calls.append((account, audience, seconds))
        return f"token-{len(self.calls)}", self.lifetime


def volumes(tmp_path: Path, spec: list[dict], issuer: Issuer | None = None,
            clock: list[float] | None = None, storage: dict | None = None,
            node: str = "node", memory: bool = False) -> PodVolumes:
    """The volumes of pod(spec) on `node` (its folder under tmp_path); `storage` maps (kind,
    name) to the claims and PersistentVolumes the node reads; `memory`: the node has a tmpfs."""
    now = clock if clock is not None else [0.0]
    found = {} if storage is None else storage
    return PodVolumes(pod(spec), tmp_path / node / "pod", tmp_path / node / "root",
                      read_object=lambda kind, ns, name: OBJECTS.get((kind, name)),
                      read_storage=lambda kind, ns, name: found.get((kind, name)),
                      issue_token=issuer or Issuer(3600), pod_ip="127.1.0.2",
                      host_ip="127.1.0.1", clock=lambda: now[0],
                      memory_dir=tmp_path / "shm" / node / "pod" if memory else None,
                      nfs_root=tmp_path / "nfs")


def claim(name: str, volume: str | None = None, phase: str = "Pending") -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {"volumeName": volume} if volume else {}, "status": {"phase": phase}}


def bound(name: str, volume: str, source: dict) -> dict:
    """Claim `name` Bound to PersistentVolume `volume` with `source`, as the node reads them."""
    return {("persistentvolumeclaim", name): claim(name, volume, "Bound"),
            ("persistentvolume", volume): {
                "metadata": {"name": volume},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                         "storageClassName": "", "persistentVolumeReclaimPolicy": "Retain",
                         "claimRef": {"namespace": "ns", "name": name, "uid": f"uid-{name}"},
                         **source}}}


def mounted(claim_name: str, read_only: bool = False) -> dict:
    return {"name": "data", "persistentVolumeClaim": {"claimName": claim_name,
                                                      "readOnly": read_only}}


def test_configmap_secret_items_and_modes(tmp_path: Path) -> None:
    paths = volumes(tmp_path, [
        {"name": "all", "configMap": {"name": "settings"}},
        {"name": "some", "configMap": {"name": "settings", "defaultMode": 0o600,
                                       "items": [{"key": "b", "path": "sub/bee.txt"}]}},
        {"name": "secret", "secret": {"secretName": "creds", "items": [
            {"key": "password", "path": "pw", "mode": 0o400}]}},
        {"name": "maybe", "configMap": {"name": "absent", "optional": True}},
    ]).prepare()
    assert sorted(p.name for p in paths["all"].iterdir()) == ["a.yaml", "b"]
    bee = paths["some"] / "sub" / "bee.txt"
    assert bee.read_bytes() == b"bee" and stat.S_IMODE(bee.stat().st_mode) == 0o600
    password = paths["secret"] / "pw"
    assert password.read_bytes() == b"pw" and stat.S_IMODE(password.stat().st_mode) == 0o400
    assert not any(paths["maybe"].iterdir())


def test_service_account_projection_renews_its_token_at_80_percent(tmp_path: Path) -> None:
    issuer, clock = Issuer(lifetime=1000.0), [0.0]
    access = volumes(tmp_path, [{"name": "kube-api-access", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt",
                                                              "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
                                    "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]}}], issuer, clock)
    folder = access.prepare()["kube-api-access"]
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "token": "token-1", "ca.crt": "CA", "namespace": "ns"}
    assert issuer.calls == [("runner", None, 3607)]
    due = TOKEN_REFRESH_FRACTION * 1000.0
    clock[0] = due - 1
    assert access.refresh() == due
    assert (folder / "token").read_text() == "token-1"
    clock[0] = due
    assert access.refresh() == due + due
    assert (folder / "token").read_text() == "token-2"


def test_host_paths_live_under_the_node_root(tmp_path: Path) -> None:
    paths = volumes(tmp_path, [
        {"name": "d", "hostPath": {"path": "/var/lib/x", "type": "DirectoryOrCreate"}},
        {"name": "f", "hostPath": {"path": "/var/lib/x/f", "type": "FileOrCreate"}},
    ]).prepare()
    assert paths["d"] == tmp_path / "node" / "root" / "var" / "lib" / "x" and paths["d"].is_dir()
    assert paths["f"].is_file()
    with pytest.raises(NotYetAvailable, match="not a Directory"):
        volumes(tmp_path, [{"name": "d", "hostPath": {"path": "/nope",
                                                       "type": "Directory"}}]).prepare()
    with pytest.raises(NotYetAvailable, match="parent directory"):
        volumes(tmp_path, [{"name": "f", "hostPath": {"path": "/no/dir/f",
                                                       "type": "FileOrCreate"}}]).prepare()


def test_missing_and_unsupported_sources(tmp_path: Path) -> None:
    with pytest.raises(NotYetAvailable, match="configMap ns/absent not found"):
        volumes(tmp_path, [{"name": "c", "configMap": {"name": "absent"}}]).prepare()
    with pytest.raises(PodSpecError, match="'iscsi'") as err:
        volumes(tmp_path, [{"name": "disk", "iscsi": {"targetPortal": "x"}}]).prepare()
    assert err.value.reason == "UnsupportedVolume"
    with pytest.raises(PodSpecError, match="only fieldRef"):
        volumes(tmp_path, [{"name": "d", "downwardAPI": {"items": [
            {"path": "cpu", "resourceFieldRef": {"resource": "limits.cpu"}}]}}]).prepare()


def test_a_claim_on_nfs_is_one_folder_for_every_node(tmp_path: Path) -> None:
    storage = bound("ckpt", "pv-ckpt", {"nfs": {"server": "nfs.local", "path": "/exports/ckpt"}})
    writer = volumes(tmp_path, [mounted("ckpt")], storage=storage, node="node-0")
    reader = volumes(tmp_path, [mounted("ckpt", read_only=True)], storage=storage, node="node-1")
    share = tmp_path / "nfs" / "nfs.local" / "exports" / "ckpt"
    assert writer.prepare()["data"] == reader.prepare()["data"] == share and share.is_dir()
    assert writer.read_only == set() and reader.read_only == {"data"}
    # the export's own readOnly holds for every claim on it
    storage = bound("ro", "pv-ro", {"nfs": {"server": "nfs.local", "path": "/ro",
                                            "readOnly": True}})
    read_only = volumes(tmp_path, [mounted("ro")], storage=storage)
    read_only.prepare()
    assert read_only.read_only == {"data"}


def test_host_path_and_local_volumes_live_under_the_node_root(tmp_path: Path) -> None:
    storage = bound("scratch", "pv-host", {"hostPath": {"path": "/mnt/scratch",
                                                        "type": "DirectoryOrCreate"}})
    assert volumes(tmp_path, [mounted("scratch")], storage=storage).prepare()["data"] == \
        tmp_path / "node" / "root" / "mnt" / "scratch"
    storage = bound("fast", "pv-local", {"local": {"path": "/mnt/nvme0"},
                                         "nodeAffinity": {"required": {}}})
    local = volumes(tmp_path, [mounted("fast")], storage=storage)
    # a local volume is a disk the node already has mounted: none, and the pod waits
    with pytest.raises(NotYetAvailable, match="local path '/mnt/nvme0' is not a Directory"):
        local.prepare()
    (tmp_path / "node" / "root" / "mnt" / "nvme0").mkdir(parents=True)
    assert local.prepare()["data"] == tmp_path / "node" / "root" / "mnt" / "nvme0"


def test_a_claim_waits_until_it_exists_and_is_bound(tmp_path: Path) -> None:
    storage: dict = {}
    waiting = volumes(tmp_path, [mounted("later")], storage=storage)
    with pytest.raises(NotYetAvailable, match="persistentVolumeClaim ns/later not found") as err:
        waiting.prepare()
    assert err.value.reason == "FailedMount"
    storage[("persistentvolumeclaim", "later")] = claim("later")
    with pytest.raises(NotYetAvailable, match="not bound to a PersistentVolume yet "
                                              r"\(phase Pending\)"):
        waiting.prepare()
    storage.update(bound("later", "pv-later", {"nfs": {"server": "s", "path": "/later"}}))
    # bound to a volume whose claimRef names another claim (a stale read): still waiting
    storage[("persistentvolume", "pv-later")]["spec"]["claimRef"]["uid"] = "uid-of-another"
    with pytest.raises(NotYetAvailable, match="PersistentVolume pv-later is not bound to it"):
        waiting.prepare()
    storage[("persistentvolume", "pv-later")]["spec"]["claimRef"]["uid"] = "uid-later"
    assert waiting.prepare()["data"] == tmp_path / "nfs" / "s" / "later"


def test_unsupported_persistent_volumes_fail_the_pod(tmp_path: Path) -> None:
    storage = bound("block", "pv-csi", {"csi": {"driver": "ebs.csi.aws.com",
                                                "volumeHandle": "vol-1"}})
    with pytest.raises(PodSpecError, match=r"source csi.*supported: nfs, hostPath, local") as err:
        volumes(tmp_path, [mounted("block")], storage=storage).prepare()
    assert err.value.reason == "UnsupportedVolume"
    storage = bound("out", "pv-out", {"nfs": {"server": "s", "path": "/a/../../../etc"}})
    with pytest.raises(PodSpecError, match="without '..'"):
        volumes(tmp_path, [mounted("out")], storage=storage).prepare()


def test_memory_empty_dirs_live_on_the_node_tmpfs_when_it_has_one(tmp_path: Path) -> None:
    spec = [{"name": "shm", "emptyDir": {"medium": "Memory"}}, {"name": "disk", "emptyDir": {}}]
    on_tmpfs = volumes(tmp_path, spec, memory=True).prepare()
    assert on_tmpfs["shm"] == tmp_path / "shm" / "node" / "pod" / "shm"
    assert on_tmpfs["disk"] == tmp_path / "node" / "pod" / "volumes" / "disk"
    without = volumes(tmp_path, spec, node="plain").prepare()
    assert without["shm"] == tmp_path / "plain" / "pod" / "volumes" / "shm"
    assert all(path.is_dir() for path in [*on_tmpfs.values(), *without.values()])
    with pytest.raises(PodSpecError, match="emptyDir medium 'HugePages'"):
        check_volumes(pod([{"name": "huge", "emptyDir": {"medium": "HugePages"}}]))
    # a folder that is no mount point is no tmpfs, whatever holds it
    assert not writable_tmpfs(tmp_path / "shm")
