"""The value of a Node's cordon annotation (`api.CORDON_ANNOTATION`): GPU indices such as "1,5".

Parsed without raising on what a person typed: each item that is not a GPU of the node is
skipped and described, so the operator reports it and the CLI refuses it with the same words.
"""

from __future__ import annotations

from collections.abc import Iterable

# No node has this many GPUs: a longer item is reported without converting it, since Python
# refuses to parse integers of more than 4,300 digits and an annotation can hold 256 kB.
MAX_INDEX_DIGITS = 6


def parse_indices(value: str, gpus: int) -> tuple[frozenset[int], tuple[str, ...]]:
    """GPU indices from a comma-separated annotation value such as "3" or "1, 5".

    Each item that is not an integer in [0, gpus) is skipped and described in the problems,
    whatever its length.
    """
    indices: set[int] = set()
    problems: list[str] = []
    for item in value.split(","):
        token = item.strip()
        if not token:
            continue
        if not (token.isascii() and token.isdigit()):
            problems.append(f"{shown(token)!r} is not a GPU index")
        elif len(token) > MAX_INDEX_DIGITS or int(token) >= gpus:
            problems.append(f"GPU {shown(token)} does not exist (the node has GPUs 0-{gpus - 1})")
        else:
            indices.add(int(token))
    return frozenset(indices), tuple(problems)


def shown(token: str) -> str:
    """An item as it goes into a message: long ones clipped so the status stays readable."""
    return token if len(token) <= 20 else f"{token[:8]}...({len(token)} characters)"


def format_indices(indices: Iterable[int]) -> str:
    """The annotation value for a set of indices: sorted, comma-separated, no spaces."""
    return ",".join(str(i) for i in sorted(set(indices)))
