"""Where a trainer reads its layout generations from: the `GenerationSource` interface, files.

A source hands out each generation's document as written; `assignment` turns it into what the
trainer runs. A Kubernetes watch plugs in as another source, in the pod's launcher.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tessera_contracts.generation import KIND, Generation, Rendezvous
from tessera_core.plan import JobLayout, generation_layout


@dataclass(frozen=True)
class Assignment:
    """One generation as the trainer runs it: its unit layout, who carries on, when it starts.

    `rendezvous` is None for explicit-layout documents, which take MASTER_ADDR/PORT.
    """

    generation: int
    layout: JobLayout
    origin: tuple[int | None, ...] | None
    at_step: int | None
    rendezvous: Rendezvous | None


def assignment(document: Mapping[str, Any]) -> Assignment:
    """A generation document (`kind: NTPGeneration`, the contract the operator writes) or an
    explicit-layout document (`JobLayout.to_dict()` with optional `generation`, `origin`,
    `at_step`: custom unit layouts, which the contract leaves to tessera_core.plan)."""
    if document.get("kind") == KIND or "schemaVersion" in document:
        gen = Generation.from_dict(document)
        return Assignment(gen.generation, generation_layout(gen), gen.origin, gen.at_step,
                          gen.rendezvous)
    origin = document.get("origin")
    return Assignment(
        generation=int(document.get("generation", 0)),
        layout=JobLayout.from_dict(document),
        origin=None if origin is None else tuple(origin),
        at_step=document.get("at_step"),
        rendezvous=None,
    )


def at_step_of(document: Mapping[str, Any]) -> int | None:
    """The step boundary a document's change is planned for (None: not planned), read without
    planning its layout (`assignment` does that: it costs the layout's size)."""
    if document.get("kind") == KIND or "schemaVersion" in document:
        return Generation.from_dict(document).at_step
    return document.get("at_step")


class GenerationSource(Protocol):
    """The job's generation documents; `get` never blocks."""

    def get(self, generation: int) -> Mapping[str, Any] | None:
        """Generation `generation`'s document if it has been published, else None."""
        ...


class FileGenerationSource:
    """`gen{N}.json` files in a directory, each written once (atomically, or retried)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get(self, generation: int) -> Mapping[str, Any] | None:
        try:
            return json.loads((self.directory / f"gen{generation}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None  # absent, or still being written


def wait_for(source: GenerationSource, generation: int, timeout_s: float) -> Assignment | None:
    """Generation `generation` once its document appears (polled: files have no events)."""
    deadline = time.monotonic() + timeout_s
    while True:
        document = source.get(generation)
        if document is not None:
            return assignment(document)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)
