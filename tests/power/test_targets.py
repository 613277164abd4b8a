"""The agent's re-validation of GPUPowerTarget objects: what it accepts, refuses, and why."""

from __future__ import annotations

import copy

import pytest
from powertest import make_target

from tessera_contracts.powertarget import InvalidTarget, parse_object, to_object

pytestmark = pytest.mark.power


def test_round_trip_through_the_api_shape() -> None:
    t = make_target(gpu_w={3: 200, 0: 640}, ramp_step_w=25)
    assert parse_object(to_object(t), "node-a") == t
    assert [g["index"] for g in to_object(t)["spec"]["gpus"]] == [0, 3]


def test_a_settled_target_keeps_the_share_and_drops_the_boosts() -> None:
    t = make_target(budget_w=3000, base_w=450, gpu_w={0: 650}, ramp_step_w=25)
    assert t.settled() == make_target(budget_w=3000, base_w=450)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o["spec"].update(baseWatts=True), "baseWatts must be an integer"),
        (lambda o: o["spec"].update(baseWatts="600"), "baseWatts must be an integer"),
        (lambda o: o["spec"].update(baseWatts=600_000), "outside"),
        (lambda o: o["spec"].update(budgetWatts=0), "budgetWatts=0 outside"),
        (lambda o: o["spec"].update(rackBudgetWatts=10), "rackBudgetWatts=10 outside"),
        (lambda o: o["spec"].update(gpus=[{"index": 1, "watts": 600}] * 2), "GPU 1 twice"),
        (lambda o: o["spec"].update(gpus=[{"index": -1, "watts": 600}]), "index=-1"),
        (lambda o: o["spec"].update(gpus=[{"index": 0, "watts": 9000}]), "watts=9000"),
        (lambda o: o["spec"].update(gpus=[7]), "must be an object"),
        (lambda o: o["spec"].update(gpus={"0": 600}), "must be a list"),
        (lambda o: o["spec"].update(rack=""), "rack must be a non-empty string"),
        (lambda o: o["spec"].pop("baseWatts"), "baseWatts must be an integer"),
        (lambda o: o["metadata"].update(name="node-b"), "for node 'node-b'"),
        (lambda o: o.update(kind="ConfigMap"), "not a tessera.dev/v1alpha1 GPUPowerTarget"),
        (lambda o: o.pop("spec"), "no spec"),
    ],
)
def test_rejects_malformed_targets_with_the_field_named(mutate, message: str) -> None:
    obj = copy.deepcopy(to_object(make_target()))
    mutate(obj)
    with pytest.raises(InvalidTarget, match=message):
        parse_object(obj, "node-a")
