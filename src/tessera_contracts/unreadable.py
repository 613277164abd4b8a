"""What a reader keeps where an object did not parse: whose it is and why, so that whoever reads
the parsed value next can say so instead of parsing it again."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unreadable:
    """An object a reader could not use; `node` is the node it is of, when it says."""

    node: str | None
    why: str
