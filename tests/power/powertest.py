"""Shared by the power tests: a valid target to start from, and a single raw write of one."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from tessera_contracts.api import GROUP, VERSION
from tessera_contracts.api import POWER_TARGET_PLURAL as PLURAL
from tessera_contracts.powertarget import PowerTarget, to_object


def make_target(node: str = "node-a", **kw) -> PowerTarget:
    fields = dict(node=node, rack="rack-0", budget_w=4600, base_w=500, rack_budget_w=4600)
    fields.update(kw)
    return PowerTarget(**fields)


def create_target(api_client: client.ApiClient, target: PowerTarget) -> dict[str, Any]:
    """Create `target`'s object as whoever `api_client` acts for: the tests of who may write a
    target (the operator itself writes through `power_targets.sync_targets`)."""
    return client.CustomObjectsApi(api_client).create_cluster_custom_object(
        GROUP, VERSION, PLURAL, to_object(target))
