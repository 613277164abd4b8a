"""The operator's objects against the real API server's size limits: the largest layout document
it publishes is accepted and a larger one reported, never sent and retried; the status of
thousands of replicas fits the job object."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import yaml
from kubernetes import client

from tessera_contracts.generation import LAYOUT_KEY, Generation, Rendezvous
from tessera_contracts.model_shape import ModelShape
from tessera_dev import paths, simnodes
from tessera_operator import apply, conditions, planner, workload
from tessera_operator.policies import publish

pytestmark = pytest.mark.operator

EXAMPLE = yaml.safe_load((paths.repo_root() / "manifests/examples/ntpjob-small.yaml").read_text())
SPEC = planner.JobSpec(
    shape=ModelShape(hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256), tp=8, dp=1)


def _generation(nodes: int) -> Generation:
    # Node names of 240 characters: each GPU takes about 250 bytes of the document.
    names = [f"{'n' * 234}-{i:05d}" for i in range(nodes)]
    plan = planner.plan(replace(SPEC, dp=nodes), {n: n for n in names}, set())
    generation = workload.generation_for(plan, 64, Rendezvous("10.0.0.1", 29400), None)
    assert generation is not None
    return generation


def _size(generation: Generation) -> int:
    return len(LAYOUT_KEY) + len(json.dumps(
        generation.to_dict(), separators=(",", ":")).encode())


def test_the_largest_layout_is_published_and_a_larger_one_reported(
    admin_api: client.ApiClient, tessera_crds: list[str], namespace: str
) -> None:
    body = copy.deepcopy(EXAMPLE) | {"metadata": {"name": "big"}}
    # on no node: an operator serving this namespace places nothing and publishes nothing
    simnodes.place_in_pool(body["spec"], "nowhere")
    job = client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        "tessera.dev", "v1alpha1", namespace, "ntptrainingjobs", body)
    # The most nodes whose document fits, found by bisection on the document's own size.
    lo, hi = 1, 1024
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _size(_generation(mid)) <= publish.CONFIGMAP_MAX_BYTES else (lo, mid)
    fits, too_big = _generation(lo), _generation(hi)
    apply.layout(admin_api, publish.layout_document(job, fits), None)
    stored = client.CoreV1Api(admin_api).read_namespaced_config_map("big-layout", namespace)
    assert Generation.from_dict(json.loads(stored.data[LAYOUT_KEY])) == fits
    with pytest.raises(publish.LayoutBlocked) as blocked:
        publish.layout_document(job, too_big)
    assert blocked.value.reason == "LayoutTooLarge" and "more than a ConfigMap holds" in str(
        blocked.value)
    # The bound is the API server's own: the same data sent anyway is refused.
    data = json.dumps(too_big.to_dict(), separators=(",", ":"))
    with pytest.raises(client.ApiException) as refused:
        client.CoreV1Api(admin_api).create_namespaced_config_map(
            namespace, {"metadata": {"name": "sent-anyway"}, "data": {LAYOUT_KEY: data}})
    assert refused.value.status == 422


def test_the_status_of_thousands_of_replicas_fits_its_object(
    admin_api: client.ApiClient, tessera_crds: list[str], namespace: str
) -> None:
    """8,192 replicas, every other one reduced (degrees alternate, so runs do not help): the
    status the operator renders is accepted by the API server, reduced replicas listed first."""
    spec = replace(SPEC, dp=8192, min_tp=4)
    names = [f"gpu-node-{i:05d}" for i in range(8192)]
    result = planner.plan(spec, {n: n for n in names}, {(n, 0) for n in names[::2]})
    status = conditions.render(result, result.problems, {}, now="2026-01-01T00:00:00Z",
                               generation=1, layout_generation=1)
    assert len(status["tpLayout"]) <= planner.TP_LAYOUT_MAX
    assert status["tpLayout"].startswith("7,8,7,8") and status["tpLayout"].endswith(
        ",... (8192 replicas)")
    listed = status["replicas"]
    assert len(listed) < 8192  # the reduced ones come first: every one of them is listed
    assert sum(r["tensorParallelSize"] == 7 for r in listed) == 4096
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert f"status.replicas lists {len(listed)} of 8192 replicas" in ready["message"]
    body = copy.deepcopy(EXAMPLE) | {"metadata": {"name": "many"}}
    jobs = client.CustomObjectsApi(admin_api)
    jobs.create_namespaced_custom_object("tessera.dev", "v1alpha1", namespace, "ntptrainingjobs",
                                         body)
    stored = jobs.patch_namespaced_custom_object_status(
        "tessera.dev", "v1alpha1", namespace, "ntptrainingjobs", "many", {"status": status})
    assert stored["status"]["tpLayout"] == status["tpLayout"]
