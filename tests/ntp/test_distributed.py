"""Only a lost or hung peer waits for a new layout generation; other collective errors raise."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ntp.distributed import is_communication_failure

# Messages as gloo 2.x and NCCL word them (captured from real runs).
PEER_LOST = [
    "[third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
    "[127.0.0.1]:3277. This is typically caused by a remote worker crashing.",
    "[third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:59571: "
    "Connection reset by peer.",
    "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for "
    "recv operation to complete",
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE)",
]
BUGS = [
    # A size mismatch between ranks' buffers: a bug, not a lost peer.
    "[enforce fail at third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= "
    "op.nbytes. 8 vs 4",
    "Split sizes doesn't match total dim 0 size",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid argument",
]


@pytest.mark.parametrize("message", PEER_LOST)
def test_a_lost_or_hung_peer_is_a_communication_failure(message):
    assert is_communication_failure(RuntimeError(message))


@pytest.mark.parametrize("message", BUGS)
def test_other_collective_errors_are_not(message):
    assert not is_communication_failure(RuntimeError(message))


def test_a_store_network_error_is_one():
    assert is_communication_failure(dist.DistNetworkError("store unreachable"))
