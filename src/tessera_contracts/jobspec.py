"""An NTPTrainingJob's spec with the CRD's defaults: the schema in package data is their one source.

The API server fills every `default:` of the schema before anyone reads a stored job (structural
defaulting); `defaulted` does the same for a spec that never went through one (a test, the
simulator, a dry run), so no reader writes a default of its own and none can disagree with the CRD.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from tessera_contracts import api


class SpecError(ValueError):
    """A job spec that cannot be used; `field` is the spec path to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field


def defaulted(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `spec` with every field the CRD defaults filled in, as the API server does:
    a missing field takes its default, then defaulting goes on inside what is there."""
    return _apply(api.job_schema(), copy.deepcopy(dict(spec)))


def _apply(schema: Mapping[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _apply(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply(schema["items"], item) for item in value]
    return value


def schema_default(path: str) -> Any:
    """The CRD's default for a dotted spec path such as `failurePolicy.mode`."""
    schema: Mapping[str, Any] = api.job_schema()
    for name in path.split("."):
        schema = schema["properties"][name]
    return copy.deepcopy(schema["default"])
