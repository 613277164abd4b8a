"""`tessera-dev image-sizes`: what each image's Python environment weighs, measured without a
container engine by installing it afresh as its Dockerfile target does (the project's wheel, the
target's extra, its constraints file) into an empty virtual environment and summing the files the
install added. The base image (python:3.11-slim) and the trainer's C compiler come on top."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tessera_dev import lock, paths

INSTALL_TIMEOUT_S = 1500
LARGEST_SHOWN = 4


def tree_size(root: Path) -> int:
    """Bytes of every file under `root`, as an image layer holds them (apparent sizes)."""
    return sum(path.lstat().st_size for path in root.rglob("*") if not path.is_dir())


def isolated_env(bin_dir: Path) -> dict[str, str]:
    """This process's environment with `bin_dir` first on PATH and nothing of ours on the import
    path, so what runs sees only its own environment."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def check(done: subprocess.CompletedProcess[str]) -> str:
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, done.args))} exited {done.returncode}\n"
                           f"{done.stdout}\n{done.stderr}")
    return done.stdout


def build_wheel(out: Path) -> Path:
    """The project's wheel in `out`, built from a copy of its metadata and source (an in-tree
    build would leave build/ in the working tree, and its stale files would ship)."""
    root = paths.repo_root()
    with tempfile.TemporaryDirectory(prefix="tessera-source-") as scratch:
        source = Path(scratch)
        shutil.copy2(root / "pyproject.toml", source)
        for folder in paths.source_folders(root):
            shutil.copytree(root / folder, source / folder, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info"))
        check(subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                              "-w", str(out), str(source)],
                             capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S))
    [built] = out.glob("*.whl")
    return built


def site_packages(venv: Path) -> Path:
    # made by this interpreter's venv module, so of this interpreter's version
    major, minor = sys.version_info[:2]
    return venv / f"lib/python{major}.{minor}/site-packages"


def install(venv: Path, wheel: Path, extra: str | None) -> tuple[int, list[tuple[str, int]]]:
    """A fresh virtual environment at `venv` holding what the image of `extra` installs (None:
    a plain install of the package, its base dependencies pinned as the operator image pins
    them); returns the bytes that install added to the empty environment, and its biggest
    entries in site-packages (name, bytes), biggest first."""
    check(subprocess.run([sys.executable, "-m", "venv", str(venv)],
                         capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S))
    empty = tree_size(venv)
    there = {entry.name for entry in site_packages(venv).iterdir()}
    # uv resolves the wheel's metadata against the same constraints as the image's pip, in a
    # tenth of the time; the Dockerfile's own pip steps are checked as text by the tests.
    check(subprocess.run(
        [Path(sys.executable).parent / "uv", "pip", "install", "--quiet", "--python",
         venv / "bin" / "python", "-c", lock.constraints_path(extra or lock.IMAGES["operator"]),
         f"{wheel}[{extra}]" if extra else wheel],
        cwd=venv, env=isolated_env(venv / "bin"), capture_output=True, text=True,
        timeout=INSTALL_TIMEOUT_S))
    added = [(entry.name, tree_size(entry) if entry.is_dir() else entry.lstat().st_size)
             for entry in site_packages(venv).iterdir() if entry.name not in there]
    return tree_size(venv) - empty, sorted(added, key=lambda item: -item[1])[:LARGEST_SHOWN]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera-dev image-sizes",
        description="Install each image's Python environment into an empty virtual environment "
                    "(the wheel, the image's extra, constraints/) and report what it adds to "
                    "the base image. Downloads from the package index; the environments are "
                    "deleted afterwards.")
    parser.add_argument("images", nargs="*", metavar="IMAGE",
                        help=f"Dockerfile targets (default all: {', '.join(lock.IMAGES)})")
    args = parser.parse_args(argv)
    if unknown := [image for image in args.images if image not in lock.IMAGES]:
        parser.error(f"unknown image {', '.join(unknown)}: the targets are "
                     f"{', '.join(lock.IMAGES)}")
    chosen = args.images or list(lock.IMAGES)
    with tempfile.TemporaryDirectory(prefix="tessera-image-sizes-") as scratch:
        wheel = build_wheel(Path(scratch))
        rows = []
        for image in chosen:
            extra = lock.IMAGES[image]
            venv = Path(scratch) / image
            added, largest = install(venv, wheel, extra)
            count = len(lock.pins(lock.constraints_path(extra).read_text()))
            biggest = ", ".join(f"{name} {size / 1e6:.0f}" for name, size in largest)
            rows.append((image, extra, str(count), f"{added / 1e6:.0f}", biggest))
            shutil.rmtree(venv)
    header = ("image", "extra", "pinned", "installed MB", f"largest {LARGEST_SHOWN} (MB)")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print("\nOn top: the base image python:3.11-slim, and for the trainer the C compiler Triton "
          "builds its launchers with (gcc, libc6-dev).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
