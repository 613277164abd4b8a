"""The docs name only modules, attributes and paths that exist: every project module named in a
Markdown file imports (and has the attribute named after it), every path resolves, and nothing
names the layout the code left behind."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.foundation

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tessera_contracts", "tessera_core", "tessera_operator", "tessera_agents", "ntp",
            "tessera_sim", "tessera_cli", "tessera_dev")
_PACKAGE = "|".join(PACKAGES)
# Not after a path, a dotted name or a flag, so `manifests/.../ntpjob-local.yaml` is no module.
_START = r"(?<![\w./-])"
DOTTED = re.compile(rf"{_START}(?:{_PACKAGE})(?:\.[A-Za-z_]\w*)+")
REPO_PATH = re.compile(
    rf"{_START}(?:src|operator|power_controller|trainer_image|crds|charts|tests|manifests|docs)"
    r"/[\w./-]*[\w/]")
PACKAGE_PATH = re.compile(rf"{_START}(?:{_PACKAGE})/[\w./-]*[\w/]")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PY_FILE = re.compile(r"[\w/]+\.py")
# Where each process's package left src/ for its deployable part's folder (the design's names).
OLD_LAYOUT = {
    re.compile(r"\bsrc/tessera_operator\b"): "the operator is operator/tessera_operator",
    re.compile(r"\bsrc/tessera_agents\b"): "the agents are power_controller/tessera_agents",
    re.compile(r"\bsrc/ntp\b"): "the trainer is trainer_image/ntp",
}


def package_folder(path: str) -> str:
    """Where a package path starting with a package's name is, from the repository root."""
    package = path.split("/")[0]
    [location] = importlib.util.find_spec(package).submodule_search_locations
    return str((Path(location) / path.split("/", 1)[-1]).relative_to(ROOT))


def markdown_files() -> list[Path]:
    """The tracked Markdown files, and new ones not ignored (the docs about to be committed)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return sorted({ROOT / name for name in listed if (ROOT / name).exists()})


def resolves(dotted: str) -> bool:
    """`dotted` names a module, or an attribute (chain) of the longest module it starts with."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module) is not None
        except (ModuleNotFoundError, ValueError):  # a parent that is a module, not a package
            found = False
        if not found:
            continue
        if cut == len(parts):
            return True
        value: object = importlib.import_module(module)
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def problems_in(doc: Path) -> Iterator[str]:
    text = doc.read_text()
    here = doc.parent
    for pattern, why in OLD_LAYOUT.items():
        for match in pattern.finditer(text):
            yield f"{match.group(0)!r}: {why}"
    for name in sorted(set(DOTTED.findall(text))):
        if not resolves(name):
            yield f"{name!r}: no such module or attribute"
    for path in sorted(set(REPO_PATH.findall(text))):
        if not (ROOT / path).exists():
            yield f"{path!r}: no such path"
    for path in sorted(set(PACKAGE_PATH.findall(text))):
        if not (here / path).exists():
            yield (f"{path!r}: no such path here (from the repository root it is "
                   f"{package_folder(path)})")
    # a link written inside a code span (a regular expression's `[a-z](...)`) is code, not a link
    for target in sorted(set(LINK.findall(CODE_SPAN.sub("", text)))):
        if re.match(r"[a-z]+:|#", target):
            continue
        if not (here / target.split("#")[0]).exists():
            yield f"link {target!r}: no such file"
    # A Python file named alone is the one beside the document (a package README's module
    # table), else one at that path from the repository root.
    for span in sorted(set(CODE_SPAN.findall(text))):
        if PY_FILE.fullmatch(span) and not ((here / span).exists() or (ROOT / span).exists()):
            yield f"{span!r}: no such file beside {doc.relative_to(ROOT)} or at the root"


def test_every_module_and_path_the_docs_name_exists():
    docs = markdown_files()
    assert ROOT / "README.md" in docs
    failures = [f"{doc.relative_to(ROOT)}: {problem}"
                for doc in docs for problem in problems_in(doc)]
    assert not failures, "\n".join(["the docs name what does not exist:", *failures])
