"""Only a lost or hung peer waits for a new layout generation (other collective errors raise);
the end of a generation is published once on the store and heard by every rank's watch."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from ntp.distributed import (
    End,
    EndReason,
    FailureWatch,
    RendezvousEnded,
    arrival_key,
    arrive,
    end_generation,
    end_key,
    is_communication_failure,
    process_key,
    ready_to_form,
    report_death,
)
from tessera_contracts.generation import Rendezvous

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


def test_the_first_end_of_a_generation_stands():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    failed = EndReason(End.FAILED, "rank 2: reset")
    assert end_generation(store, 3, failed) == failed
    assert end_generation(store, 3, EndReason(End.SUPERSEDED)) == failed
    assert end_generation(store, 4, EndReason(End.SUPERSEDED)) == EndReason(End.SUPERSEDED)
    # the store holds the text every trainer process reads
    assert store.get(end_key(3)).decode() == "failed: rank 2: reset"


def test_a_launcher_ends_the_generation_its_dead_child_was_in():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(process_key("node-a", 41), "5")
    assert report_death(store, "node-a", 41, first_generation=1, why="exited with -9") == 5
    assert store.get(end_key(5)).decode() == "failed: process node-a/41 exited with -9"
    # a child that never joined a generation broke the first one's rendezvous
    assert report_death(store, "node-a", 42, first_generation=1, why="exited with 1") == 1


def test_a_planned_generation_forms_once_the_processes_it_adds_have_come():
    """Its survivors train on until then (`ntp.membership.Membership.agreed_switch`)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert ready_to_form(store, 2, joiners=0)  # a cordon adds nobody
    assert not ready_to_form(store, 2, joiners=1)
    left: list[RendezvousEnded] = []

    # A fresh process does first: come to the rendezvous and wait. It has its own connection,
    # as a process does: one client's socket answers one request at a time.
    joiner_store = dist.TCPStore("127.0.0.1", store.port, is_master=False)

    def joiner() -> None:
        try:
            arrive(joiner_store, 2, world_size=3)
        except RendezvousEnded as exc:
            left.append(exc)

    thread = threading.Thread(target=joiner, daemon=True)
    thread.start()
    try:
        store.wait([arrival_key(2)])
        assert ready_to_form(store, 2, joiners=1)
        assert not ready_to_form(store, 2, joiners=2)
    finally:
        # A generation that ended before its new processes came has nobody left to wait for:
        # the survivors go on to it and past it (`Membership.join_formed`); the joiner leaves.
        end_generation(store, 2, EndReason(End.FAILED, "the joiner's GPU failed again"))
        thread.join()
    assert ready_to_form(store, 2, joiners=2)
    assert [exc.generation for exc in left] == [2]


@pytest.mark.parametrize(("reason", "aborted"), [(EndReason(End.FAILED, "x"), True),
                                                 (EndReason(End.SUPERSEDED), False)])
def test_a_watch_aborts_only_a_failed_generation(reason, aborted):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    calls: list[str] = []
    ended = threading.Event()
    watch = FailureWatch(
        Rendezvous("127.0.0.1", store.port),
        7,
        abort=lambda: calls.append("abort"),
        on_end=lambda: (calls.append("end"), ended.set()),
    )
    end_generation(store, 7, reason)
    assert watch.join() == reason
    assert ended.is_set()
    assert calls == (["abort", "end"] if aborted else ["end"])


@pytest.mark.parametrize("reason", [EndReason(End.FAILED, "process node-a/41 exited with -9"),
                                    EndReason(End.FAILED), EndReason(End.SUPERSEDED),
                                    EndReason(End.FINISHED)])
def test_an_end_reason_reads_back_as_written(reason):
    assert EndReason.decode(reason.encode()) == reason


@pytest.mark.parametrize("text", ["", "done", "Failed: x", "finished!"])
def test_a_text_no_trainer_writes_is_no_end_reason(text):
    with pytest.raises(ValueError, match="not a generation's end reason"):
        EndReason.decode(text)
