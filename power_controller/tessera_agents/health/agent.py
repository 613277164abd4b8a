"""The node health agent (`tessera health-agent`): this node's dcgm-exporter page -> its GPUHealth.

It finds its node's exporter through the API: the EndpointSlices of the exporter's Service
(`--exporter-namespace`, `--exporter-service`, `--exporter-port`; the GPU Operator's names by
default), the endpoint on its own node (`discovery.exporter_url`; or the exporter pods on its
node, `--exporter-discovery pods`), found again when a read fails and every `REDISCOVER_S`; or,
for an exporter on the host's network, at a fixed `--exporter-url`.
Every `--interval` it reads that exporter, classifies the GPUs (`dcgm.assess`),
damps flaps and publishes the facts in the node's cluster-scoped `GPUHealth` object, named after
the node: per GPU Healthy, Failed (a DCGM health watch failing on something other than an XID,
or an XID after which the device is gone: 79, off the bus) or Unknown, and the recent XIDs,
which each job judges by its own `fatalXIDs`
(`tessera_operator.health.from_gpu_health`); the object's form is
`tessera_contracts.gpuhealth.render`'s. It writes only when a GPU's state or XIDs change,
and otherwise once per `--refresh`, so that `observedAt` tells a reader the object is current.
docs/health.md says why each node publishes its own health; the admission policy in
manifests/power-controller/admission.yaml lets an agent write its own node's object only.
Its command line is `main.py`; it serves its metrics and readiness from `metrics.py`.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field, replace
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from typing import Any, Protocol

from tessera_agents.bounded import call_all, open_connection, shut_at
from tessera_agents.health import discovery
from tessera_agents.health.dcgm import MAX_PAGE_BYTES, FlapDamper, assess
from tessera_contracts.api import GPU_HEALTH_PLURAL, GROUP, HEALTH_AGENT_MANAGER, VERSION
from tessera_contracts.gpuhealth import (
    MAX_GPUS,
    REFRESH_S,
    NodeHealth,
    PublishedHealth,
    State,
    render,
    summary,
)

log = logging.getLogger("tessera.health-agent")

MAX_LOGGED_PROBLEMS = 20  # per read: a hostile page can have a problem on every line
# A replaced exporter pod whose old address is taken by another pod would still answer there:
# the slices are read again this often even while reads succeed.
REDISCOVER_S = 60.0


class FetchError(Exception):
    """The exporter did not answer with a page; `reason` is the kind of failure, one of
    READ_ERRORS (the label of the agent's read-error counter)."""

    def __init__(self, message: str, reason: str = "unreachable") -> None:
        super().__init__(message)
        self.reason = reason


# discovery: no endpoint found, or the API read failed; unreachable: no connection or a broken
# answer; timeout: no page within the fetch timeout; http: a status other than 2xx
READ_ERRORS = ("discovery", "unreachable", "timeout", "http")


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def fetch_page(url: str, timeout_s: float) -> str:
    """The exporter's page, at most MAX_PAGE_BYTES + 1 bytes (so that `classify` can tell a page
    that is too large), read within `timeout_s` in all: name, connection, TLS, status line,
    headers and body under one deadline (`bounded.shut_at`). No proxy and no redirect: the page
    comes from the node's own exporter or not at all. FetchError says why there is none."""
    deadline = time.monotonic() + timeout_s
    parts = urllib.parse.urlsplit(url)
    tls = parts.scheme == "https"
    try:
        host, port = parts.hostname or "", parts.port or (443 if tls else 80)
        sock = open_connection(host, port, timeout_s)
    except (OSError, ValueError) as err:  # ValueError: a port that is not a number
        raise FetchError(f"{url}: {err!r}",
                         "timeout" if isinstance(err, TimeoutError) else "unreachable") from err
    late = FetchError(f"{url}: no page within {timeout_s:g} s", "timeout")
    with closing(sock), shut_at(sock, deadline - time.monotonic()) as expired:
        try:
            page = _get(sock, url, parts, tls)
        except (OSError, HTTPException, ValueError) as err:
            raise (late if expired.is_set() else FetchError(f"{url}: {err!r}")) from err
    if expired.is_set():  # the shutdown ends a response where it stands, headers or body
        raise late
    return page


def _get(sock: socket.socket, url: str, parts: urllib.parse.SplitResult, tls: bool) -> str:
    host = parts.hostname or ""
    connection = (HTTPSConnection if tls else HTTPConnection)(host, parts.port)
    try:
        connection.sock = _tls().wrap_socket(sock, server_hostname=host) if tls else sock
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", target, headers={"Accept": "text/plain"})
        with connection.getresponse() as response:
            if not 200 <= response.status < 300:
                raise FetchError(f"HTTP {response.status} from {url}", "http")
            chunks: list[bytes] = []
            size = 0
            while size <= MAX_PAGE_BYTES:
                chunk = response.read1(min(1 << 16, MAX_PAGE_BYTES + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    finally:
        connection.close()
    return b"".join(chunks).decode("utf-8", errors="replace")


class Exporter(Protocol):
    """What the agent reads: `url`, the current one ("" while none is known), and `fetch()`, a
    page or FetchError."""

    url: str

    def fetch(self) -> str: ...


class FixedExporter:
    """The exporter at one URL (`--exporter-url`: one on the host's network)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s

    def fetch(self) -> str:
        return fetch_page(self.url, self.timeout_s)


class DiscoveredExporter:
    """The exporter `locate` names (the URL of this node's endpoint of the exporter's Service),
    located before the first read, every `rediscover_s`, and again when a read fails: an
    exporter pod that was replaced answers at its new address. `url` is "" until one is found."""

    def __init__(self, locate: Callable[[], str], timeout_s: float,
                 rediscover_s: float = REDISCOVER_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.locate, self.timeout_s = locate, timeout_s
        self.rediscover_s, self.monotonic = rediscover_s, monotonic
        self.url = ""
        self._due = -math.inf

    def fetch(self) -> str:
        if not self.url or self.monotonic() >= self._due:
            self._locate()
        try:
            return fetch_page(self.url, self.timeout_s)
        except FetchError:
            known = self.url
            self._locate()
            if self.url == known:
                raise
            return fetch_page(self.url, self.timeout_s)

    def _locate(self) -> None:
        try:
            url = self.locate()
        except discovery.NotFound as err:
            raise FetchError(str(err), "discovery") from err
        except Exception as err:  # the API server unreachable, refused, slow: tried next read
            raise FetchError(f"looking up the exporter through the API: {err}",
                             "discovery") from err
        if url != self.url:
            log.info("exporter of this node found at %s", url)
        self.url, self._due = url, self.monotonic() + self.rediscover_s


class Lister:
    """One list call of the API, its items as dicts (as the API server serves them), within
    `timeout_s` in all."""

    def __init__(self, api_client: Any, call: Callable[..., Any], timeout_s: float,
                 **query: str) -> None:
        self._client, self._call, self._timeout, self._query = api_client, call, timeout_s, query

    def __call__(self) -> list[dict[str, Any]]:
        result = call_all({"list": lambda: self._call(**self._query,
                                                      _request_timeout=self._timeout)},
                          self._timeout)["list"]
        if isinstance(result, Exception):
            raise result
        return self._client.sanitize_for_serialization(result.items)


def as_facts(observed: NodeHealth) -> NodeHealth:
    """`observed` as this node publishes it: classified with no XID of a job's list fatal (so
    Failed means a failure no job's list decides: a health watch failing on something other
    than an XID, or a device gone), each GPU's recent XIDs named for the jobs to judge."""
    return replace(observed, gpus=tuple(
        replace(g, reason=f"recent XID {', '.join(map(str, g.xids))}: each job's fatalXIDs "
                          "decide")
        if g.state is State.HEALTHY and g.xids else g
        for g in observed.gpus))


@dataclass
class HealthAgent:
    """One node's read -> classify -> damp -> publish cycle; `step()` runs one.

    `gpus` is the node's GPU count, or 0 to learn it from the pages: every GPU seen on one since
    the agent started is published (as Unknown while the page does not show it). What it saw
    is kept for its metrics (`metrics.HealthCollector`): whether the last read succeeded, when
    one last did, the failed reads by reason, the pages it could not use, and the GPUs as last
    published. `wall` is the clock of observedAt and of the page's age, `monotonic` that of
    damping and refreshes."""

    node: str
    exporter: Exporter
    publish: Callable[[dict[str, Any]], None]
    gpus: int = 0
    refresh_s: float = REFRESH_S
    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic
    damper: FlapDamper = field(default_factory=lambda: FlapDamper(hold_xids=True))
    _page: str | None = None
    _fetched_at: float | None = None
    _known: int = 0
    _published: tuple[Any, ...] | None = None
    _published_at: float = -math.inf
    _logged: frozenset[str] = frozenset()
    _fetch_error: str | None = None
    up: bool = False
    read_errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(READ_ERRORS, 0))
    parse_errors: int = 0
    published: NodeHealth | None = None  # as last written, None before the first write

    @property
    def read_at(self) -> float | None:
        """Wall time of the last successful read."""
        return self._fetched_at

    def step(self) -> NodeHealth:
        """Read the exporter once and publish if a GPU's state or XIDs changed, or the last
        write is `refresh_s` old; returns what it would publish. A failed read is logged when
        its error changes; a failed write is logged and tried again at the next step."""
        error = None
        try:
            self._page, self._fetched_at = self.exporter.fetch(), self.wall()
        except FetchError as err:
            error = str(err)
            self.read_errors[err.reason] = self.read_errors.get(err.reason, 0) + 1
        self.up = error is None
        if error != self._fetch_error:
            if error is not None:
                log.warning("exporter of %s: %s", self.node, error)
            else:
                log.info("exporter of %s answers again", self.node)
            self._fetch_error = error
        now = self.wall()
        observed = as_facts(assess(self._page, fetched_at=self._fetched_at, now=now,
                                   gpus=self.gpus or MAX_GPUS, fatal_xids=(),
                                   hostname=self.node, error=error))
        if error is None and observed.error is not None:
            self.parse_errors += 1
        self._log_problems(observed.problems)
        damped = self.damper.update(self.monotonic(), observed)
        seen = [g.index for g in observed.gpus if g.state is not State.UNKNOWN]
        self._known = self.gpus or max([self._known, *(i + 1 for i in seen)])
        health = replace(damped, gpus=damped.gpus[:self._known])
        key = (health.error is None, tuple((g.index, g.state, g.xids) for g in health.gpus))
        if key != self._published or self.monotonic() - self._published_at >= self.refresh_s:
            if key != self._published:
                log.info("GPUs of %s: failed [%s], XIDs [%s], unknown [%s]%s", self.node,
                         *summary(health.gpus).values(),
                         f" ({health.error})" if health.error else "")
            try:
                self.publish(render(PublishedHealth(self.node, self.exporter.url, now, health)))
            except Exception as err:  # unreachable, refused: the next step writes again
                log.warning("could not publish the GPU health of %s: %s", self.node, err)
            else:
                self._published, self._published_at = key, self.monotonic()
                self.published = health
        return health

    def _log_problems(self, problems: tuple[str, ...]) -> None:
        """Each problem once while it lasts, at most MAX_LOGGED_PROBLEMS per read."""
        new = [p for p in problems if p not in self._logged]
        for line in new[:MAX_LOGGED_PROBLEMS]:
            log.warning("exporter page: %s", line)
        if len(new) > MAX_LOGGED_PROBLEMS:
            log.warning("exporter page: %d more problems not logged",
                        len(new) - MAX_LOGGED_PROBLEMS)
        self._logged = frozenset(problems[:1000])


class KubePublisher:
    """Writes the node's GPUHealth by server-side apply (creating it the first time), within
    `timeout_s` in all: the client's timeout bounds each read of the answer, not the answer, so
    a write still unanswered at the deadline is abandoned (TimeoutError) and the next step's
    write goes on."""

    def __init__(self, api_client: Any, timeout_s: float) -> None:
        from kubernetes import client

        self._api, self._timeout = client.CustomObjectsApi(api_client), timeout_s

    def __call__(self, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        result = call_all({name: lambda: self._api.patch_cluster_custom_object(
            GROUP, VERSION, GPU_HEALTH_PLURAL, name, body,
            field_manager=HEALTH_AGENT_MANAGER, force=True,
            _content_type="application/apply-patch+yaml", _request_timeout=self._timeout)},
            self._timeout)[name]
        if isinstance(result, Exception):
            raise result
