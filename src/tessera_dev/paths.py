"""Where the checkout's own files are: the repository root that holds manifests/."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path


def repo_root() -> Path:
    """The checkout the development tooling runs from; it must be installed editable.

    The local cluster applies the checkout's kustomizations and example jobs, which are not
    package data (the CRDs are: `tessera_contracts.api`), so a copy of the package installed into
    site-packages has no way to reach them: say so rather than fail on a missing file.
    """
    root = Path(__file__).resolve().parents[2]
    if not (root / "manifests").is_dir():
        raise FileNotFoundError(
            f"no manifests/ folder at {root}: tessera-dev must run from its checkout "
            "(pip install -e . in the repository)")
    return root


def source_folders(root: Path) -> tuple[str, ...]:
    """The folders the project's wheel is built from: each package root pyproject.toml names
    (the shared packages, and each deployable part's), and crds/, which the contracts carry as
    package data through their link to it."""
    where = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["where"]
    return (*where, "crds")


def default_data_dir() -> Path:
    """Where `tessera-dev up` keeps its control plane: $TESSERA_STATE_DIR or the XDG state dir."""
    if "TESSERA_STATE_DIR" in os.environ:
        return Path(os.environ["TESSERA_STATE_DIR"]) / "controlplane"
    xdg = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(xdg) / "tessera" / "controlplane"
