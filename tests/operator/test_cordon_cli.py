"""`tessera cordon-gpu` / `uncordon-gpu` against a real kube-apiserver: every bad input ends in one
clear line and exit 1, never a traceback, and nothing it writes can lock later edits out."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from tessera_cli import cordon, uncordon
from tessera_contracts.api import CORDON_ANNOTATION
from tessera_dev.controlplane import launcher

pytestmark = pytest.mark.operator


def _node(admin: client.ApiClient, gpus: int | None, cordoned: str | None = None) -> str:
    name = f"cli-{uuid.uuid4().hex[:8]}"
    body = {"metadata": {"name": name,
                         "annotations": {} if cordoned is None else {CORDON_ANNOTATION: cordoned}}}
    client.CoreV1Api(admin).create_node(body)
    if gpus is not None:  # what a device plugin reports through the kubelet
        client.CoreV1Api(admin).patch_node_status(
            name, {"status": {"capacity": {"nvidia.com/gpu": str(gpus)}}})
    return name


def _annotation(admin: client.ApiClient, node: str) -> str | None:
    meta = client.CoreV1Api(admin).read_node(node).metadata
    return (meta.annotations or {}).get(CORDON_ANNOTATION)


@pytest.fixture
def cli(control_plane: launcher.ControlPlane, capsys: pytest.CaptureFixture[str]):
    """Run a command as the admin; returns (exit code, stdout, stderr)."""
    def run(main, *args: str) -> tuple[int, str, str]:
        code = main([*args, "--kubeconfig", str(control_plane.kubeconfig)])
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


def test_a_gpu_past_the_nodes_capacity_is_refused(admin_api, cli) -> None:
    node = _node(admin_api, 8)
    assert cli(cordon.main, node, "8") == (
        1, "", f"tessera cordon-gpu: node {node} has 8 GPUs (0-7); no GPU 8\n")
    assert _annotation(admin_api, node) is None


def test_without_a_capacity_no_index_can_lock_the_node_out(admin_api, cli) -> None:
    node = _node(admin_api, None)
    code, _, err = cli(cordon.main, node, "70000")
    assert code == 1 and "reports no nvidia.com/gpu capacity" in err and "no GPU 70000" in err
    assert _annotation(admin_api, node) is None
    # What it does accept, later edits read back.
    assert cli(cordon.main, node, "63")[0] == 0
    assert cli(cordon.main, node, "2")[0] == 0
    assert _annotation(admin_api, node) == "2,63"
    assert cli(uncordon.main, node, "63")[0] == 0
    assert _annotation(admin_api, node) == "2"


def test_a_huge_item_in_the_annotation_is_reported_not_raised(admin_api, cli) -> None:
    node = _node(admin_api, 8, cordoned="1," + "9" * 5000)
    code, out, err = cli(cordon.main, node, "3")
    assert code == 1 and out == ""
    assert "is malformed" in err and "(5000 characters) does not exist" in err
    assert "Traceback" not in err and len(err) < 12_000  # the value, quoted once
    assert _annotation(admin_api, node) == "1," + "9" * 5000


def test_a_huge_gpu_argument_is_a_usage_error(admin_api, cli) -> None:
    node = _node(admin_api, 8)
    with pytest.raises(SystemExit) as exit_:
        cli(cordon.main, node, "9" * 5000)
    assert exit_.value.code == 2
