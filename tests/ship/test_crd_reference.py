"""docs/crd-reference.md is what `tessera-dev crd-reference` renders from the CRDs the package
ships: a schema change without a new reference fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera_contracts import api
from tessera_dev import crdref

pytestmark = pytest.mark.ship

REPO = Path(__file__).resolve().parents[2]


def test_the_reference_is_rendered_from_the_current_schemas() -> None:
    written = (REPO / crdref.DOC).read_text()
    assert written == crdref.render(), (
        f"{crdref.DOC} differs from the CRDs' schemas: run `tessera-dev crd-reference`")


def table_row(reference: str, section: str, field: str) -> list[str]:
    """The cells of `field`'s row in the table of the object at `section`."""
    _, _, rest = reference.partition(f"\n### `{section}`\n")
    table = rest.split("\n### ", 1)[0]
    [row] = [line for line in table.splitlines() if line.startswith(f"| `{field}` |")]
    return [cell.strip() for cell in row.strip("|").split(" | ")]


def test_every_kind_and_what_a_user_must_know_of_a_field_is_there() -> None:
    reference = crdref.render()
    for crd in api.crd_documents():
        assert f"\n## {crd['spec']['names']['kind']}\n" in reference
    # name, type, required, default, validation, description
    name, kind, required, default, validation, description = table_row(
        reference, "spec.failurePolicy", "mode")
    assert (kind, required, default) == ("string", "", '`"NTP"`')
    assert "one of `NTP`, `NTP-PW`, `DROP`, `SPARE`" in validation
    assert description.startswith("NTP shrinks the hit TP group")
    # immutable through a rule on oldSelf one object up, bounds and a cross-field rule
    _, kind, required, _, validation, _ = table_row(reference, "spec", "tensorParallelSize")
    assert (kind, required) == ("integer", "yes")
    assert validation.startswith("**immutable**; >= 1; <= 576")
    assert "tensorParallelSize must not exceed model.heads" in validation
    # a rule that names a field two objects down lands on that field
    _, _, _, _, validation, _ = table_row(reference, "spec.template.spec", "serviceAccountName")
    assert validation.startswith("**immutable**")
    _, _, _, _, validation, _ = table_row(reference, "spec", "steps")
    assert "immutable" not in validation
