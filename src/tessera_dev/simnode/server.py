"""Two HTTP endpoints: the node's kubelet endpoint (HTTPS, container logs) and the DCGM exporter's
(served by the exporter pod, `exporter.py`).

The API server reaches the kubelet endpoint for `kubectl logs` at the node's InternalIP and
`daemonEndpoints.kubeletEndpoint.Port`, with its kubelet client certificate; a client must show a
certificate signed by --client-ca, and the API server must say (SubjectAccessReview) that its
user may `get nodes/proxy` of this node, as a kubelet with webhook authorization asks. The
exporter renders the node's simulated GPUs on each scrape.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 0.2  # how often a followed log is checked for new lines, as `tail -f` does

# (namespace, pod, container, previous) -> (log file, whether the container still runs), or None
LogFinder = Callable[[str, str, str, bool], tuple[Path, Callable[[], bool]] | None]
# (user, groups) -> whether that client may use the kubelet API (`nodes/proxy` of this node)
Authorizer = Callable[[str, list[str]], bool]


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _client(self) -> tuple[str, list[str]]:
        """The verified client certificate's user (CN) and groups (O), as the API server reads
        them."""
        subject = self.connection.getpeercert()["subject"]  # type: ignore[attr-defined]
        fields = [(key, value) for rdn in subject for key, value in rdn]
        user = next((v for k, v in fields if k == "commonName"), "")
        return user, [v for k, v in fields if k == "organizationName"]

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        url = urlsplit(self.path)
        name = url.path.split("/")[1] if "/" in url.path else ""
        route = self.server.routes.get(name)
        if route is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n")
            return
        authorize = self.server.authorize
        if authorize is not None and name != "healthz":
            user, groups = self._client()
            if not authorize(user, groups):
                self._send(HTTPStatus.FORBIDDEN, f"Forbidden (user={user}, verb=get, "
                           "resource=nodes, subresource=proxy)\n".encode())
                return
        route(self, url.path, parse_qs(url.query))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    routes: dict[str, Callable[[_Handler, str, dict[str, list[str]]], None]]
    authorize: Authorizer | None = None


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[0].lower() in ("1", "true")


def _container_logs(find: LogFinder) -> Callable[[_Handler, str, dict[str, list[str]]], None]:
    def serve(handler: _Handler, path: str, query: dict[str, list[str]]) -> None:
        parts = path.strip("/").split("/")
        if len(parts) != 4:
            handler._send(HTTPStatus.NOT_FOUND, b"expected /containerLogs/NS/POD/CONTAINER\n")
            return
        _, namespace, pod, container = parts
        found = find(namespace, pod, container, _flag(query, "previous"))
        if found is None or not found[0].exists():
            handler._send(HTTPStatus.NOT_FOUND, f"no logs for container {container!r} of pod "
                          f"{namespace}/{pod} on this node\n".encode())
            return
        path_, running = found
        # one open file for what is there and what follows, so a line written in between is
        # neither lost nor sent twice
        with open(path_, "rb") as file:
            data = file.read()
            if "tailLines" in query:
                data = _tail(data, int(query["tailLines"][0]))
            if "limitBytes" in query:
                data = data[:int(query["limitBytes"][0])]
            if not _flag(query, "follow"):
                handler._send(HTTPStatus.OK, data)
                return
            # streamed until the container stops: no length, the connection's end ends the body
            handler.send_response(HTTPStatus.OK)
            handler.send_header("Content-Type", "text/plain")
            handler.end_headers()
            handler.wfile.write(data)
            handler.wfile.flush()
            while True:
                chunk = file.read()
                if chunk:
                    handler.wfile.write(chunk)
                    handler.wfile.flush()
                elif not running():
                    return
                else:
                    time.sleep(FOLLOW_POLL_S)
    return serve


def _healthz(handler: _Handler, _path: str, _query: dict[str, list[str]]) -> None:
    handler._send(HTTPStatus.OK, b"ok")


def _metrics(render: Callable[[], str]) -> Callable[[_Handler, str, dict[str, list[str]]], None]:
    def serve(handler: _Handler, _path: str, _query: dict[str, list[str]]) -> None:
        try:
            page = render()
        except Exception as exc:  # a scrape fails with the reason; the node serves on
            log.exception("rendering the DCGM page failed")
            handler._send(HTTPStatus.INTERNAL_SERVER_ERROR, f"{exc}\n".encode())
            return
        handler._send(HTTPStatus.OK, page.encode(), "text/plain; version=0.0.4")
    return serve


def _serve(server: _Server, name: str) -> _Server:
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def kubelet_endpoint(address: str, port: int, *, cert: Path, key: Path, client_ca: Path,
                     find_logs: LogFinder, authorize: Authorizer) -> _Server:
    """Serve /containerLogs and /healthz over HTTPS to clients with a certificate from client_ca;
    /containerLogs only to those `authorize` admits, as a kubelet in webhook mode."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    context.load_verify_locations(str(client_ca))
    context.verify_mode = ssl.CERT_REQUIRED
    server = _Server((address, port), _Handler)
    # the handshake happens in the request's thread, so a slow client cannot stall the others
    server.socket = context.wrap_socket(server.socket, server_side=True,
                                        do_handshake_on_connect=False)
    server.routes = {"containerLogs": _container_logs(find_logs), "healthz": _healthz}
    server.authorize = authorize
    return _serve(server, "kubelet-endpoint")


def exporter_endpoint(address: str, port: int, render: Callable[[], str]) -> _Server:
    """Serve the DCGM exporter's /metrics, rendered on each scrape, and its /health."""
    server = _Server((address, port), _Handler)
    server.routes = {"metrics": _metrics(render), "health": _healthz}
    return _serve(server, "dcgm-exporter")
