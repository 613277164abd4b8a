"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it.

A replica leads while it holds the Lease: it takes it when no one holds it or the holder let it
expire, and renews it every `retry_s`. The others read it every `retry_s` and count its expiry
from when they saw it change on their own clock (never from the holder's timestamps, so clock
skew between nodes cannot shorten it). A leader that cannot renew for `renew_deadline_s` stops
leading before the Lease can expire (`lease_s` later than its last renewal), so two replicas
never reconcile at once; one that stops cleanly releases the Lease by deleting it, so a standby
takes it (creating it anew) on its next read instead of after the expiry, and an uninstall, whose
replicas all stop, leaves no Lease behind.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tessera_contracts.api import OPERATOR_NAME
from tessera_operator import metrics

LEASE_NAME = OPERATOR_NAME
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timing:
    """How long a Lease lasts, a leader keeps trying to renew it, and between two tries
    (`tessera operator` takes controller-runtime's defaults: 15, 10 and 2 s)."""

    lease_s: float
    renew_deadline_s: float
    retry_s: float

    def problem(self) -> str | None:
        """Why these durations cannot keep two leaders apart; None when they can."""
        if not 0 < self.retry_s < self.renew_deadline_s < self.lease_s:
            return (f"leader election needs 0 < retry period ({self.retry_s:g} s) < renew "
                    f"deadline ({self.renew_deadline_s:g} s) < lease duration "
                    f"({self.lease_s:g} s)")
        return None


class Elector:
    """One replica's side of the Lease `namespace/name`, as `identity`."""

    def __init__(self, api: client.ApiClient, namespace: str, identity: str, timing: Timing,
                 name: str = LEASE_NAME) -> None:
        self._leases = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity, self.timing = namespace, name, identity, timing
        self._seen: tuple[Any, ...] | None = None  # the record as last read, and when (local)
        self._seen_at = 0.0
        self._renewed_at: float | None = None  # when the last renewal that succeeded was sent
        self._answered_at: float | None = None  # when the API server last answered a try
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def leading(self) -> bool:
        return self._renewed_at is not None

    def healthy(self) -> bool:
        """Whether the Lease was read or written within its duration (a standby that can
        take over when it must)."""
        return (self._answered_at is not None
                and time.monotonic() - self._answered_at < self.timing.lease_s)

    def acquire(self, stop: threading.Event) -> bool:
        """Try every `retry_s` until this replica leads (True) or `stop` is set (False)."""
        while not stop.is_set():
            if self._try():
                log.info(f"leading: holding Lease {self.namespace}/{self.name} as "
                         f"{self.identity}")
                return True
            stop.wait(self.timing.retry_s)
        return False

    def keep(self, lost: Callable[[], None]) -> None:
        """Renew every `retry_s` in a thread; after `renew_deadline_s` without a renewal
        call `lost` (which must stop this replica's reconciles: the Lease expires soon after)."""
        def renew() -> None:
            while not self._stop.wait(self.timing.retry_s):
                while not self._try():
                    assert self._renewed_at is not None
                    left = self._renewed_at + self.timing.renew_deadline_s - time.monotonic()
                    if self._stop.is_set():
                        return
                    if left <= 0:
                        self._renewed_at = None
                        metrics.LEADER.set(0)
                        log.error(f"lost Lease {self.namespace}/{self.name}: not renewed in "
                                  f"{self.timing.renew_deadline_s:g} s")
                        lost()
                        return
                    self._stop.wait(min(self.timing.retry_s, left))

        self._renewer = threading.Thread(target=renew, name="lease-renewer", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        """Stop renewing and, if leading, give the Lease up by deleting it (only the version read
        here, still held by this replica), so a standby takes it on its next read."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if not self.leading:
            return
        self._renewed_at = None
        metrics.LEADER.set(0)
        try:
            lease = self._read()
            if lease is None or lease["spec"].get("holderIdentity") != self.identity:
                return
            meta = lease["metadata"]
            self._leases.delete_namespaced_lease(
                self.name, self.namespace, _request_timeout=self.timing.renew_deadline_s,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(
                    resource_version=meta["resourceVersion"], uid=meta["uid"])))
            log.info(f"released Lease {self.namespace}/{self.name}")
        except (ApiException, HTTPError) as exc:
            metrics.api_error(exc)
            log.warning(f"releasing Lease {self.namespace}/{self.name} failed (a standby "
                        f"takes it when it expires): {exc}")

    def _try(self) -> bool:
        """One read and, if the Lease is free, expired or ours, one write; whether this replica
        holds it now. A write races others' by resourceVersion: one wins, the rest get 409."""
        sent = time.monotonic()
        # A renewal ends by the renew deadline: a leader then never outlives its Lease.
        timeout = self.timing.renew_deadline_s if self._renewed_at is None else max(
            0.1, self._renewed_at + self.timing.renew_deadline_s - sent)
        try:
            lease = self._read(timeout)
            read = time.monotonic()
            now = _micro_time()
            if lease is None:
                self._leases.create_namespaced_lease(self.namespace, {
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(now, now, 0)}, _request_timeout=timeout)
            else:
                spec = lease["spec"]
                holder = spec.get("holderIdentity")
                record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
                if record != self._seen:
                    self._seen, self._seen_at = record, read
                duration = spec.get("leaseDurationSeconds") or self.timing.lease_s
                if holder and holder != self.identity and read - self._seen_at < duration:
                    self._answered_at = time.monotonic()
                    return False
                ours = holder == self.identity
                lease["spec"] = self._spec(
                    spec.get("acquireTime") if ours else now, now,
                    (spec.get("leaseTransitions") or 0) + (0 if ours or not holder else 1))
                self._leases.replace_namespaced_lease(self.name, self.namespace, lease,
                                                      _request_timeout=timeout)
        except (ApiException, HTTPError) as exc:
            if not (isinstance(exc, ApiException) and exc.status == 409):
                metrics.api_error(exc)
                log.warning(f"Lease {self.namespace}/{self.name}: {exc}")
            return False
        self._answered_at = time.monotonic()
        if self._renewed_at is None:
            metrics.LEADER.set(1)
        self._renewed_at = sent
        return True

    def _read(self, timeout: float | None = None) -> dict[str, Any] | None:
        try:
            response = self._leases.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False,
                _request_timeout=timeout or self.timing.renew_deadline_s)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        lease = json.loads(response.data)
        lease.setdefault("spec", {})
        return lease

    def _spec(self, acquired: str, renewed: str, transitions: int) -> dict[str, Any]:
        return {"holderIdentity": self.identity,
                "leaseDurationSeconds": math.ceil(self.timing.lease_s),
                "acquireTime": acquired, "renewTime": renewed, "leaseTransitions": transitions}


def _micro_time() -> str:
    """Now as the API's MicroTime."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
