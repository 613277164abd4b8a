"""`tessera uncordon-gpu NODE GPU`: give a cordoned GPU back to Tessera's planner."""

from __future__ import annotations

import sys

from tessera_cli.cordon import run


def main(argv: list[str]) -> int:
    return run(argv, cordon=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
