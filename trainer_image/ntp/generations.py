"""Layout generations on disk: gen{N}.json documents, planned switches and fault drills."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def wait_for_generation(directory: Path, generation: int, timeout_s: float) -> dict | None:
    """The layout document of `generation` (`gen{N}.json` in `directory`), once it appears."""
    path = directory / f"gen{generation}.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        document = _read(path)
        if document is not None:
            return document
        time.sleep(0.05)
    return None


def _read(path: Path) -> dict | None:
    """The document at `path`, or None while it is absent or still being written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def planned_switch(directory: Path, generation: int, step: int) -> dict | None:
    """The next generation's document if it schedules a switch at this step (`"at_step"`).

    Failure documents carry no `at_step`: ranks only read them after a collective failed.
    """
    document = _read(directory / f"gen{generation}.json")
    return document if document is not None and document.get("at_step") == step else None


def injected_fault(generation: int, rank: int, step: int) -> bool:
    """TESSERA_FAULT_AT=RANK:STEP makes that rank of the first generation die at that step
    (failure drills and tests)."""
    spec = os.environ.get("TESSERA_FAULT_AT")
    return generation == 0 and spec is not None and spec == f"{rank}:{step}"
