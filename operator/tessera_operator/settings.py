"""kopf's settings and the operator's shared state, set once in kopf's startup handler.

What the handlers share lives in kopf's memo: the API client, the clock (injected, so tests and
simulations drive the same code in their own time), the node cache (`cache.NodeCache`), the
last-seen filters of the watch predicates (`cache.LastSeen`), the job queue
(`jobqueue.JobQueue`), the placement lock and each job's last refused status write (said
once). kopf gives each object a shallow copy of the memo: what is shared is made here.
"""

from __future__ import annotations

import logging
import re
import threading
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client

from tessera_contracts.api import JOB_LABEL
from tessera_kube import clients
from tessera_operator import cache, jobqueue

# Every API call of the operator carries this timeout: a stalled server must not hold a
# reconcile (nor every job's placement behind it).
API_TIMEOUT_S = 10.0
# The namespaced kinds the operator watches only as far as they are a job's own (labelled with
# it): a large cluster's other objects would otherwise each cost an event.
JOB_CHILD_KINDS = (("", "v1", "pods"), ("", "v1", "configmaps"), ("", "v1", "serviceaccounts"),
                   ("rbac.authorization.k8s.io", "v1", "roles"),
                   ("rbac.authorization.k8s.io", "v1", "rolebindings"))


class QuietSuccess(logging.Filter):
    """Drops kopf's "Handler '...' succeeded." lines: one per watch event of every node and pod
    the operator sees, which bury what its handlers and reconciles say. Failures still log."""

    SUCCEEDED = re.compile(r"Handler '[^']*' succeeded\.")

    def filter(self, record: logging.LogRecord) -> bool:
        # kopf writes these lines whole, with no arguments: a record with arguments is another
        # line, and formatting it here could raise into the caller
        return not (record.levelno == logging.INFO and not record.args
                    and self.SUCCEEDED.fullmatch(str(record.msg)) is not None)


QUIET_SUCCESS = QuietSuccess()  # one instance: a logger adds the same filter once


def api_client() -> client.ApiClient:
    """$KUBECONFIG where it is set; else in the cluster the pod's service account (as kopf logs
    in)."""
    return clients.api_client()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # No peering objects to keep: the leader Lease (`leader`) lets one replica reconcile.
    settings.peering.standalone = True
    # Our CRDs exist before the operator starts: no need to list CRDs and namespaces (which
    # least privilege does not grant) to discover resources appearing later.
    settings.scanning.disabled = True
    # Idle watches can go silent without an error: make the server end them, and re-list.
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 10
    # Memory that follows the cluster's size, held at once: the first listing of 8,192 nodes
    # read in one response, and kopf's worker per object, which keeps that object's last body
    # until it has been idle this long (default 5 s: a storm of node updates holds them all).
    settings.watching.chunk_size = 500
    settings.queueing.idle_timeout = 0.5
    # Filtered by the API server, not here.
    for kind in JOB_CHILD_KINDS:
        settings.watching.label_selectors[kind] = JOB_LABEL
    # Events come from our decisions; kopf's own log lines become events only when they warn.
    settings.posting.level = logging.WARNING
    logging.getLogger("kopf.objects").addFilter(QUIET_SUCCESS)
    memo.setdefault("api", api_client())
    memo.setdefault("clock", lambda: datetime.now(UTC))
    memo.nodes = cache.NodeCache()
    memo.seen = cache.LastSeen()
    memo.queue = jobqueue.JobQueue()
    memo.placing = threading.Lock()  # one job's placement at a time
    memo.status_refused = {}  # job -> the API server's last refusal of its status, said once


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    memo.api.close()
