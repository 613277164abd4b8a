"""Where the checkout's own files are: the repository root that holds crds/ and manifests/."""

from __future__ import annotations

from pathlib import Path


def repo_root() -> Path:
    """The checkout this package runs from; it must be installed editable (`pip install -e .`).

    The CRDs and example manifests are not package data, so a copy of the package installed
    into site-packages has no way to reach them: say so rather than fail on a missing file.
    """
    root = Path(__file__).resolve().parents[2]
    if not (root / "crds").is_dir():
        raise FileNotFoundError(
            f"no crds/ folder at {root}: tessera must run from its checkout "
            "(pip install -e . in the repository)")
    return root
