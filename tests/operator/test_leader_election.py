"""Leader election on the Lease, against the real API server, as the operator's service account
with the shipped RBAC: one replica leads, the other takes over when the holder stops renewing,
a release hands over at once, and a leader that cannot renew stops before its Lease expires."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client, config
from opharness import MANIFESTS, OPERATOR_SA, SYSTEM_NS, apply_manifests

from tessera_dev import probes
from tessera_dev.controlplane import launcher
from tessera_operator import leader

pytestmark = pytest.mark.operator

# Short, so a takeover after an expiry is quick to see; still ordered as the defaults are.
TIMING = leader.Timing(lease_s=6.0, renew_deadline_s=4.0, retry_s=0.5)


@pytest.fixture
def operator_api(control_plane: launcher.ControlPlane, admin_api: client.ApiClient
                 ) -> Iterator[client.ApiClient]:
    """The operator's own identity, no Lease yet."""
    apply_manifests(admin_api, MANIFESTS)
    leases = client.CoordinationV1Api(admin_api)
    try:
        leases.delete_namespaced_lease(leader.LEASE_NAME, SYSTEM_NS)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    token = control_plane.service_account_token(SYSTEM_NS, OPERATOR_SA)
    with config.new_client_from_config_dict(control_plane.token_kubeconfig(
            token, f"system:serviceaccount:{SYSTEM_NS}:{OPERATOR_SA}")) as api:
        yield api


class Standby:
    """An elector trying to acquire in a thread, and when it came to lead."""

    def __init__(self, elector: leader.Elector) -> None:
        self.elector, self.stop, self.led_at = elector, threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.elector.acquire(self.stop):
            self.led_at = time.monotonic()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.elector.release()


def _holder(api: client.ApiClient) -> tuple[str | None, int]:
    spec = client.CoordinationV1Api(api).read_namespaced_lease(leader.LEASE_NAME, SYSTEM_NS).spec
    return spec.holder_identity, spec.lease_transitions or 0


def _elector(api: client.ApiClient, identity: str) -> leader.Elector:
    return leader.Elector(api, SYSTEM_NS, identity, TIMING)


def test_one_leads_and_the_other_takes_over_once_the_holder_stops_renewing(
        operator_api: client.ApiClient, admin_api: client.ApiClient) -> None:
    first, second = _elector(operator_api, "replica-a"), _elector(operator_api, "replica-b")
    assert first.acquire(threading.Event())
    first.keep(lost=lambda: pytest.fail("replica-a lost a Lease it renews"))
    standby = Standby(second)
    try:
        # Renewed: the standby never leads, however long it waits, and stays healthy.
        time.sleep(2 * TIMING.lease_s)
        assert standby.led_at is None and not second.leading and second.healthy()
        assert _holder(admin_api) == ("replica-a", 0)
        # replica-a stops renewing (a crash: no release).
        first._stop.set()
        stopped = time.monotonic()
        probes.poll_until(lambda: standby.led_at, timeout=6 * TIMING.lease_s,
                          error=lambda _: AssertionError("replica-b never took over"))
        assert standby.led_at is not None
        waited = standby.led_at - stopped
        assert TIMING.lease_s - TIMING.retry_s <= waited <= TIMING.lease_s + 4 * TIMING.retry_s, \
            waited
        assert _holder(admin_api) == ("replica-b", 1)
        print(f"\ntook over {waited:.1f} s after the holder stopped renewing")
    finally:
        standby.close()


def test_a_release_on_stop_hands_over_at_once(operator_api: client.ApiClient,
                                              admin_api: client.ApiClient) -> None:
    first, second = _elector(operator_api, "replica-a"), _elector(operator_api, "replica-b")
    assert first.acquire(threading.Event())
    first.keep(lost=lambda: pytest.fail("replica-a lost a Lease it renews"))
    standby = Standby(second)
    try:
        probes.poll_until(second.healthy, timeout=30,
                          error=lambda _: AssertionError("replica-b never read the Lease"))
        released = time.monotonic()
        first.release()
        assert not first.leading
        probes.poll_until(lambda: standby.led_at, timeout=6 * TIMING.lease_s,
                          error=lambda _: AssertionError("replica-b never took over"))
        assert standby.led_at is not None
        # The next read takes it: a retry period, not the Lease's expiry.
        assert standby.led_at - released < TIMING.lease_s / 2, standby.led_at - released
        assert _holder(admin_api)[0] == "replica-b"
        print(f"\ntook over {standby.led_at - released:.2f} s after the release")
    finally:
        standby.close()


def _leading_then_taken(elector: leader.Elector, admin_api: client.ApiClient
                        ) -> tuple[threading.Event, float]:
    """`elector` leads and renews, then someone else holds its Lease (an administrator's edit):
    its renewals find it taken. The event its loss sets, and when the Lease was taken."""
    lost = threading.Event()
    assert elector.acquire(threading.Event())
    elector.keep(lost=lost.set)
    leases = client.CoordinationV1Api(admin_api)
    lease = leases.read_namespaced_lease(leader.LEASE_NAME, SYSTEM_NS)
    lease.spec.holder_identity = "someone-else"
    taken = time.monotonic()
    leases.replace_namespaced_lease(leader.LEASE_NAME, SYSTEM_NS, lease)
    return lost, taken


def test_a_leader_that_cannot_renew_stops_before_its_lease_expires(
        operator_api: client.ApiClient, admin_api: client.ApiClient) -> None:
    elector = _elector(operator_api, "replica-a")
    lost, taken = _leading_then_taken(elector, admin_api)
    assert lost.wait(TIMING.lease_s), "still leading after its Lease expired"
    stopped = time.monotonic() - taken
    assert stopped <= TIMING.lease_s
    print(f"\nstopped leading {stopped:.1f} s after its Lease was taken")
    assert not elector.leading
    elector.release()  # not leading: leaves someone else's Lease alone
    assert _holder(admin_api)[0] == "someone-else"


@pytest.mark.hardening
def test_a_leader_stops_at_its_renew_deadline_not_at_its_leases_end(
        operator_api: client.ApiClient, admin_api: client.ApiClient) -> None:
    """A Lease ten times the renew deadline: a leader whose renewals fail (someone else holds
    the Lease now) stops a renew deadline after its last renewal, long before the Lease it last
    renewed would expire (a standby may take it then, and two leaders must never overlap)."""
    timing = leader.Timing(lease_s=30.0, renew_deadline_s=3.0, retry_s=0.5)
    elector = leader.Elector(operator_api, SYSTEM_NS, "replica-a", timing)
    lost, taken = _leading_then_taken(elector, admin_api)
    # its last renewal came before `taken`: it must stop by `taken` + the renew deadline, and
    # half the Lease's duration leaves a loaded machine 12 s of slack
    assert lost.wait(timing.lease_s / 2), "still leading half a Lease after its renewals failed"
    print(f"\nstopped leading {time.monotonic() - taken:.1f} s after its Lease was taken")
    assert not elector.leading
    elector.release()


@pytest.mark.hardening
def test_a_leader_that_stops_with_no_standby_leaves_no_lease(
        operator_api: client.ApiClient, admin_api: client.ApiClient) -> None:
    """An uninstall stops every replica: the leader's release deletes the Lease, so nothing of
    the operator is left in its namespace."""
    elector = _elector(operator_api, "replica-a")
    assert elector.acquire(threading.Event())
    elector.keep(lost=lambda: pytest.fail("replica-a lost a Lease it renews"))
    elector.release()
    with pytest.raises(client.ApiException) as gone:
        client.CoordinationV1Api(admin_api).read_namespaced_lease(leader.LEASE_NAME, SYSTEM_NS)
    assert gone.value.status == 404


@pytest.mark.parametrize("flags, says", [
    (["--leader-elect-renew-deadline", "20"], "renew deadline (20 s) < lease duration (15 s)"),
    (["--leader-elect-retry-period", "0"], "0 < retry period (0 s)"),
])
def test_leader_election_durations_that_cannot_keep_leaders_apart_are_refused(
        flags: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tessera_operator.run", "--leader-elect",
                           "--leader-elect-namespace", SYSTEM_NS, *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
