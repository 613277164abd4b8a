"""Specs the schema refuses outright, and cheaply: a batch no replica split can train, and lists
whose validation must not cost the API server more than their length limit allows."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
import yaml
from kubernetes import client

from tessera_contracts.api import GROUP, JOB_PLURAL, VERSION
from tessera_dev import paths

pytestmark = pytest.mark.hardening

EXAMPLE = yaml.safe_load(
    (paths.repo_root() / "manifests" / "examples" / "ntpjob-small.yaml").read_text())
# What refusing a list of 100,000 integers costs the server when its validation is linear:
# decoding about 700 kB of JSON and one length check. A set's uniqueness check, quadratic in the
# length, held the server for more than 30 s on this machine.
REFUSAL_BOUND_S = 2.0


@pytest.fixture
def jobs(admin_api: client.ApiClient, tessera_crds: list[str]) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(admin_api)


def _refused(jobs: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> str:
    with pytest.raises(client.ApiException) as err:
        jobs.create_namespaced_custom_object(GROUP, VERSION, namespace, JOB_PLURAL, body,
                                             dry_run="All")
    assert err.value.status == 422, err.value.body
    return str(json.loads(err.value.body)["message"])


def _job(name: str) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": name}
    return body


def test_a_batch_smaller_than_the_replicas_is_refused(jobs, namespace) -> None:
    body = _job("tiny-batch")
    body["spec"]["globalBatch"] = 1  # two replicas: one would train nothing
    message = _refused(jobs, namespace, body)
    assert "spec.globalBatch" in message and "dataParallelReplicas" in message
    body["spec"]["globalBatch"] = 2
    jobs.create_namespaced_custom_object(GROUP, VERSION, namespace, JOB_PLURAL, body,
                                         dry_run="All")


# 100,000 entries each: distinct XIDs past the range an item may hold, one XID repeated, an
# unknown source repeated. Checked item by item, each bad one would cost the server an error.
HUGE = {
    "distinct XIDs": ("fatalXIDs", list(range(1, 100_001))),
    "one XID": ("fatalXIDs", [79] * 100_000),
    "unknown sources": ("healthSources", ["smart"] * 100_000),
}


@pytest.mark.parametrize("case", HUGE)
def test_a_huge_failure_policy_list_is_refused_fast(jobs, namespace, case) -> None:
    field, items = HUGE[case]
    body = _job("huge-list")
    body["spec"]["failurePolicy"][field] = items
    started = time.monotonic()
    message = _refused(jobs, namespace, body)
    took = time.monotonic() - started
    assert f"spec.failurePolicy.{field}" in message and "must have at most" in message
    assert took < REFUSAL_BOUND_S, f"refusing {case} took {took:.1f} s"
