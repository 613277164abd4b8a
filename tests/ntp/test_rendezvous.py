"""The job's rendezvous listens on its own address only: two rendezvous processes on two loopback
addresses (two pods, or two local clusters, on one host) take the same port and are two stores,
and the port on any other address is not served."""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tessera_dev import probes
from tessera_kube.lifetime import die_with_parent

pytestmark = pytest.mark.hardening

# Addresses no local cluster hands out first (clusters take 127.B.K.x from B = 1 up).
HOSTS = ("127.254.0.2", "127.254.0.3")
# A hang guard: each process imports torch on 2 shared cores.
START_S = 120.0


def _rendezvous(host: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ntp.rendezvous", "--host", host, "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent())


def test_two_rendezvous_share_a_port_on_two_addresses(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind((HOSTS[0], 0))
        port = probe.getsockname()[1]
    procs = {host: _rendezvous(host, port, tmp_path / f"{host}.log") for host in HOSTS}
    try:
        for host, proc in procs.items():
            log = tmp_path / f"{host}.log"
            text = probes.poll_until(
                log.read_text, lambda t, p=proc: "listening" in t or p.poll() is not None,
                timeout=START_S, error=lambda t, h=host: AssertionError(f"{h}: {t!r}"))
            assert f"TCPStore listening on {host}:{port}" in text, text
        clients = {host: dist.TCPStore(host, port, is_master=False,
                                       timeout=timedelta(seconds=30)) for host in HOSTS}
        for host, store in clients.items():
            store.set("owner", host)
        assert {host: store.get("owner").decode() for host, store in clients.items()} == {
            host: host for host in HOSTS}
        # Nothing answers the port on the host's other addresses.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        for proc in procs.values():
            proc.terminate()
    assert [proc.wait(timeout=START_S) for proc in procs.values()] == [0, 0]
