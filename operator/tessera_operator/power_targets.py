"""The operator's side of the power channel: one cluster-scoped `GPUPowerTarget` per node, named
after it.

The operator writes the spec (`write_sync`: only what changed, cuts before the raises that depend
on them); the agent reads it and writes only its status (`tessera_agents.power.target_source`). RBAC
and admission in manifests/power-controller/ let only the operator's service account write specs and
an agent only its own node's status, and the agent re-validates every object it reads
(`powertarget.parse_object`). Every call carries a timeout so that neither side can hang on an
unreachable API server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_contracts.api import GROUP, JOB_UID_LABEL, OPERATOR_MANAGER, VERSION
from tessera_contracts.api import POWER_TARGET_PLURAL as PLURAL
from tessera_contracts.powertarget import (
    OPTIONAL_FIELDS,
    PowerTarget,
    to_object,
)
from tessera_operator.power_planning import SyncPlan, plan_sync

DEFAULT_TIMEOUT_S = 5.0
FIELD_MANAGER = OPERATOR_MANAGER


def _api(api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


@dataclass(frozen=True)
class SyncResult:
    """What one pass (`write_sync`) did: nodes written, deleted, and raises held back until the
    cuts they depend on are reported in effect (`pending`: call again when a status changes)."""

    written: tuple[str, ...]
    deleted: tuple[str, ...]
    held: tuple[str, ...]

    @property
    def pending(self) -> bool:
        return bool(self.held)


def list_job_targets(api_client: client.ApiClient, job_label: tuple[str, str], uid: str,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """The job's targets as the API holds them (by `job_label` and the job's UID)."""
    selector = f"{job_label[0]}={job_label[1]},{JOB_UID_LABEL}={uid}"
    return _api(api_client).list_cluster_custom_object(
        GROUP, VERSION, PLURAL, label_selector=selector, _request_timeout=timeout_s)["items"]


def sync_targets(
    api_client: client.ApiClient,
    desired: Sequence[PowerTarget],
    *,
    job_owner: Mapping[str, Any],
    job_label: tuple[str, str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SyncResult:
    """Bring a job's targets to `desired` without taking any rack over its budget: its targets
    read (by `job_label` and the owner's UID), one pass planned from them and written
    (`write_sync`). Cuts go out at once, raises only once every node of the rack reports its
    current budget in effect (`power_planning.stage`); a target for a node not in `desired`
    is deleted in a rack `desired` no longer plans (its agent then settles at the base cap
    inside its last share), and kept, settled, in a rack it still plans, whose raises then wait
    until `desired` plans the node again (parked) (`power_planning.plan_sync`). `desired`
    empty releases every target of the job."""
    listed = list_job_targets(api_client, job_label, str(job_owner["uid"]), timeout_s)
    return write_sync(api_client, plan_sync(listed, desired), listed, job_owner=job_owner,
                      job_label=job_label, timeout_s=timeout_s)


def write_sync(
    api_client: client.ApiClient,
    plan: SyncPlan,
    listed: Sequence[Mapping[str, Any]],
    *,
    job_owner: Mapping[str, Any],
    job_label: tuple[str, str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SyncResult:
    """Write one pass of `plan` (`power_planning.plan_sync` over `listed`, the job's targets as
    listed; it decides what goes out and what waits, `sync_targets` says how): each target it
    writes by server-side apply (field manager `tessera-operator`), after a merge patch of
    what another writer left in its spec, then each deletion. `job_owner` is the job's
    ownerReference (apiVersion, kind, name, uid); only its UID is written (as the label
    `tessera.dev/job-uid`): see JOB_UID_LABEL."""
    api = _api(api_client)
    objects = {obj["metadata"]["name"]: obj for obj in listed}
    labels = {job_label[0]: job_label[1], JOB_UID_LABEL: str(job_owner["uid"])}
    for node, target in sorted(plan.write.items()):
        body = to_object(target)
        body["metadata"]["labels"] |= labels
        # new to the job, the object may exist all the same (another job's, another writer's)
        obj = objects.get(node) or fetch(api_client, node, timeout_s) or {}
        stray = _stray(obj, body["spec"])
        if stray is not None:
            api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, node, stray,
                                            _request_timeout=timeout_s)
        api.patch_cluster_custom_object(
            GROUP, VERSION, PLURAL, node, body, field_manager=FIELD_MANAGER, force=True,
            _content_type="application/apply-patch+yaml", _request_timeout=timeout_s)
    for node in plan.delete:
        withdraw(api_client, node, timeout_s)
    return SyncResult(tuple(sorted(plan.write)), plan.delete, plan.held)


def _stray(obj: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that overwrites what another writer (say an administrator's `kubectl
    edit`) left in `obj`'s spec and applying `spec` would keep, or None when there is none.

    Apply removes only what its own field manager set: an optional field or a GPU's boost that
    someone else wrote would outlive the plan. A merge patch replaces the boost list whole and
    deletes the fields it nulls, whoever set them."""
    others = any(m.get("manager") != FIELD_MANAGER or m.get("operation") != "Apply"
                 for m in (obj.get("metadata") or {}).get("managedFields") or []
                 if "f:spec" in (m.get("fieldsV1") or {}))
    old = obj.get("spec") or {}
    fields = [f for f in OPTIONAL_FIELDS if f in old and f not in spec]
    listed = {g["index"] for g in spec["gpus"]}
    if not others or not (fields or any(g["index"] not in listed for g in old.get("gpus", []))):
        return None
    return {"spec": dict.fromkeys(fields) | dict(spec)}


def withdraw(api_client: client.ApiClient, node: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Delete the node's target: its agent then settles at the base cap inside its last share."""
    try:
        _api(api_client).delete_cluster_custom_object(
            GROUP, VERSION, PLURAL, node, _request_timeout=timeout_s
        )
    except ApiException as err:
        if err.status != 404:
            raise


def fetch(
    api_client: client.ApiClient, node: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any] | None:
    """The node's target object as the API holds it, or None when there is none."""
    try:
        return _api(api_client).get_cluster_custom_object(
            GROUP, VERSION, PLURAL, node, _request_timeout=timeout_s
        )
    except ApiException as err:
        if err.status == 404:
            return None
        raise
