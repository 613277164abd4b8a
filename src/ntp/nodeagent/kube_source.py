"""The node agent's generation source on Kubernetes: a watch on the job's layout ConfigMap.

The operator publishes each generation in ONE ConfigMap, `<job>-layout`, under the key
`generation.json`: the document `tessera_contracts.generation.Generation.to_dict()` as JSON. This
source lists and watches that one object with a `metadata.name` field selector, so the pod's
identity needs no more than a Role with `resourceNames: [<job>-layout]` and the verbs get, list and
watch. It lists again after every watch ends or fails, logs one line per API error and retries, and
hands out a document only once it has parsed as a generation newer than the last one: a malformed or
stale document is logged and skipped, never read as a new generation.

The agent writes its node's progress report (`tessera_contracts.progress`) into the job's ConfigMap
`<job>-progress`, which the operator creates: a strategic-merge PATCH of its own key alone
(`progress_writer`), so nodes never overwrite each other's reports and the Role needs only get
and patch on that one name. This is the one `ntp` module that imports the Kubernetes client.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

from tessera_contracts.generation import LAYOUT_KEY, Generation, GenerationError, layout_configmap
from tessera_contracts.progress import NodeReport, progress_configmap, report_key

# Where a pod finds its own namespace (the service account's projected volume).
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
log = logging.getLogger(__name__)


class SourceError(RuntimeError):
    """The source cannot be set up (no credentials, no namespace); the message says why."""


# The longest a progress write may take: the agent's last report is written as it exits.
WRITE_TIMEOUT_S = 10.0


def connect(namespace: str | None = None) -> tuple[client.ApiClient, str]:
    """A client with the pod's own identity (in-cluster config, else $KUBECONFIG), and the
    namespace, by default the pod's."""
    try:
        if "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config()
        else:
            config.load_kube_config()
    except config.ConfigException as exc:
        raise SourceError(f"no Kubernetes credentials: {exc}") from None
    if namespace is None:
        try:
            namespace = POD_NAMESPACE_FILE.read_text().strip()
        except OSError:
            raise SourceError(f"--namespace is needed outside a pod ({POD_NAMESPACE_FILE} "
                              "is unreadable)") from None
    return client.ApiClient(), namespace


def progress_writer(api: client.ApiClient, namespace: str, job: str
                    ) -> Callable[[NodeReport], None]:
    """Writes a node's report as the key `<node>.json` of the job's progress ConfigMap; an
    API error (the ConfigMap not created yet, an outage) raises client.ApiException or a
    connection error, for the caller to log and retry."""
    core, name = client.CoreV1Api(api), progress_configmap(job)

    def write(report: NodeReport) -> None:
        core.patch_namespaced_config_map(
            name, namespace, {"data": {report_key(report.node): report.to_json()}},
            # the client would send a dict as a JSON patch (a list of operations) by default
            _content_type="application/strategic-merge-patch+json",
            _request_timeout=WRITE_TIMEOUT_S,
        )

    return write


class KubeGenerationSource:
    """Generation documents as the job's layout ConfigMap shows them, followed by a watch.

    `get(n)` returns generation n if this source has seen it (a `GenerationSource`); `latest()`
    the newest generation seen. Start the watch with `start()`.
    """

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        job: str,
        watch_s: int = 60,
        retry_s: tuple[float, float] = (0.5, 5.0),
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = layout_configmap(job)
        self.watch_s = watch_s  # the server ends each watch after this; then a fresh list
        self.retry_s = retry_s  # first and longest wait after an API error
        self._documents: dict[int, dict[str, Any]] = {}
        self._skipped: set[str] = set()  # resourceVersions already logged as unusable
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, name="layout-watch", daemon=True)

    def __repr__(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    # -- what the agent reads ------------------------------------------------------------------

    def get(self, generation: int) -> Mapping[str, Any] | None:
        with self._changed:
            return self._documents.get(generation)

    def latest(self) -> int | None:
        with self._changed:
            return max(self._documents, default=None)

    def wait_newer(self, generation: int, timeout_s: float) -> int | None:
        """The newest generation once it is past `generation`, None after `timeout_s`."""
        with self._changed:
            self._changed.wait_for(
                lambda: max(self._documents, default=0) > generation, timeout=timeout_s
            )
            newest = max(self._documents, default=0)
        return newest if newest > generation else None

    # -- the watch -----------------------------------------------------------------------------

    def start(self) -> KubeGenerationSource:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following (at the next event or the end of the current watch)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _run(self) -> None:
        wait = self.retry_s[0]
        while not self._stop.is_set():
            try:
                self._follow()
                log.debug("%s: the watch ended, listing again", self)
                wait = self.retry_s[0]
                continue
            except client.ApiException as exc:
                if exc.status == 410:  # the watch fell behind the server's history
                    log.info("%s: watch expired (410), listing again", self)
                    continue
                log.warning("%s: API error %s %s; retrying in %.1f s", self, exc.status,
                            exc.reason, wait)
            except Exception as exc:  # an outage must not end the watch
                log.warning("%s: API unreachable (%s: %s); retrying in %.1f s", self,
                            type(exc).__name__, exc, wait)
            self._stop.wait(wait)
            wait = min(2 * wait, self.retry_s[1])

    def _follow(self) -> None:
        """List the ConfigMap, then watch it from that version until the watch ends."""
        selector = f"metadata.name={self.name}"
        listed = self.core.list_namespaced_config_map(
            self.namespace, field_selector=selector, _request_timeout=self.watch_s
        )
        for item in listed.items:
            self._take(item)
        self._watch = watch.Watch()
        for event in self._watch.stream(
            self.core.list_namespaced_config_map,
            self.namespace,
            field_selector=selector,
            resource_version=listed.metadata.resource_version,
            timeout_seconds=self.watch_s,
            _request_timeout=self.watch_s + 10,
        ):
            if event["type"] in ("ADDED", "MODIFIED"):
                self._take(event["object"])
            elif event["type"] == "DELETED":
                log.warning("%s was deleted; waiting for the next generation", self)

    def _take(self, configmap: client.V1ConfigMap) -> None:
        """Keep the ConfigMap's document if it is a valid generation newer than the last."""
        version = configmap.metadata.resource_version
        text = (configmap.data or {}).get(LAYOUT_KEY)
        try:
            if text is None:
                raise GenerationError(LAYOUT_KEY, "missing from the ConfigMap")
            try:
                document = json.loads(text)
            except json.JSONDecodeError as exc:
                raise GenerationError(LAYOUT_KEY, f"not JSON: {exc}") from None
            number = Generation.from_dict(document).generation
        except GenerationError as exc:
            if version not in self._skipped:
                self._skipped.add(version)
                log.warning("%s (resourceVersion %s): malformed generation document skipped, "
                            "waiting for a valid one: %s", self, version, exc)
            return
        with self._changed:
            newest = max(self._documents, default=0)
            if number in self._documents:
                if document != self._documents[number] and version not in self._skipped:
                    self._skipped.add(version)
                    log.warning("%s (resourceVersion %s): generation %d was rewritten; a "
                                "published generation is immutable, the change is ignored",
                                self, version, number)
                return
            if number < newest:
                log.warning("%s: generation %d is older than %d, which this agent has seen; "
                            "ignored", self, number, newest)
                return
            self._documents[number] = document
            self._changed.notify_all()
        log.info("%s: generation %d", self, number)
