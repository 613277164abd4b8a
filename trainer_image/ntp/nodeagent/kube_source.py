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
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client

from tessera_contracts.generation import LAYOUT_KEY, Generation, GenerationError, layout_configmap
from tessera_contracts.progress import NodeReport, progress_configmap, report_key
from tessera_kube import clients
from tessera_kube.listwatch import ListWatch

log = logging.getLogger(__name__)


class SourceError(RuntimeError):
    """The source cannot be set up (no credentials, no namespace); the message says why."""


# The longest a progress write may take: the agent's last report is written as it exits.
WRITE_TIMEOUT_S = 10.0


def connect(namespace: str | None = None) -> tuple[client.ApiClient, str]:
    """A client with the pod's own identity (in a pod its service account, else $KUBECONFIG),
    and the namespace, by default the pod's."""
    try:
        api = clients.api_client()
    except clients.CredentialsError as exc:
        raise SourceError(str(exc)) from None
    namespace = namespace or clients.pod_namespace()
    if namespace is None:
        raise SourceError(f"--namespace is needed outside a pod ({clients.POD_NAMESPACE_FILE} "
                          "is unreadable)")
    return api, namespace


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
        self.namespace = namespace
        self.name = layout_configmap(job)
        self._documents: dict[int, dict[str, Any]] = {}
        self._skipped: set[str] = set()  # resourceVersions already logged as unusable
        self._changed = threading.Condition()
        # the server ends each watch after watch_s, and the watch resumes; retry_s: first and
        # longest wait after an API error
        self._watch = ListWatch(
            client.CoreV1Api(api).list_namespaced_config_map, namespace,
            field_selector=f"metadata.name={self.name}", on_list=self._listed,
            on_event=self._event, on_error=self._failed, watch_s=watch_s, retry_s=retry_s,
            name="layout-watch")

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
        self._watch.start()
        return self

    def stop(self) -> None:
        """Stop following (at the next event or the end of the current watch)."""
        self._watch.stop()

    def _listed(self, items: list[dict[str, Any]]) -> None:
        for item in items:
            self._take(item)

    def _event(self, kind: str, configmap: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self._take(configmap)
        elif kind == "DELETED":
            log.warning("%s was deleted; waiting for the next generation", self)

    def _failed(self, exc: Exception) -> None:
        if isinstance(exc, client.ApiException):
            log.warning("%s: API error %s %s; listing again", self, exc.status, exc.reason)
        else:  # an outage must not end the watch
            log.warning("%s: API unreachable (%s: %s); listing again", self,
                        type(exc).__name__, exc)

    def _take(self, configmap: Mapping[str, Any]) -> None:
        """Keep the ConfigMap's document if it is a valid generation newer than the last."""
        version = configmap["metadata"]["resourceVersion"]
        text = (configmap.get("data") or {}).get(LAYOUT_KEY)
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
