"""Pod volumes as the kubelet fills them: keys and modes, projections, token renewal, refusals."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tessera_dev.simnode.podspec import NotYetAvailable, PodSpecError
from tessera_dev.simnode.volumes import TOKEN_REFRESH_FRACTION, PodVolumes

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
            clock: list[float] | None = None) -> PodVolumes:
    now = clock if clock is not None else [0.0]
    return PodVolumes(pod(spec), tmp_path / "pod", tmp_path / "root",
                      read_object=lambda kind, ns, name: OBJECTS.get((kind, name)),
                      issue_token=issuer or Issuer(3600), pod_ip="127.1.0.2",
                      host_ip="127.1.0.1", clock=lambda: now[0])


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
    assert paths["d"] == tmp_path / "root" / "var" / "lib" / "x" and paths["d"].is_dir()
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
