"""Build the control plane (kube-apiserver, kube-scheduler, kube-controller-manager, etcd), helm
and, when asked, Kueue's controller from the Go module registry into a cache keyed by version.

The Kubernetes module's own go.mod points its staging modules (k8s.io/api, ...) at ./staging
paths that do not exist outside its repository; we rewrite each of those replaces to the
published v0.X.Y module so `go build k8s.io/kubernetes/cmd/...` works from the proxy. helm's and
Kueue's modules replace nothing, so `go install module/cmd@version` builds each as released.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path

# Newest first: if a release does not build from the registry we fall back to earlier minors.
KUBERNETES_VERSIONS = ("v1.37.2", "v1.36.3", "v1.35.4")
# Kubernetes 1.37 requires etcd v3.7.0; module version selection would raise a lower pin anyway.
ETCD_VERSION = "v3.7.0"

# The Kubernetes binaries of one release, built together so they share one compile of the tree.
KUBERNETES_COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
BINARIES = (*KUBERNETES_COMMANDS, "etcd")

# helm, for the chart's tests (charts/tessera); its module's go.mod replaces nothing, so
# `go install module/cmd@version` builds it as released.
HELM_MODULE = "helm.sh/helm/v4"
HELM_VERSION = "v4.3.2"

# Kueue's controller, for `tessera-dev up --kueue` and the tests marked kueue: built only when
# asked, about 660 CPU-seconds from a cold Go cache (its own k8s.io v0.36 tree, not the control
# plane's). Pinned: the module proxy's version list is stale and `@latest` names an older release.
# Its CRDs, RBAC and webhooks are rendered from the same module's config/default (kubectl's
# kustomize, offline once the module is in the Go module cache) and cached beside the binary.
KUEUE_MODULE = "sigs.k8s.io/kueue"
KUEUE_VERSION = "v0.19.2"
KUEUE_MANIFESTS = "config/default"

_STAGING_REPLACE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/src/\S+\s*$", re.M)


def cache_root() -> Path:
    return Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera"))


def bin_dir(k8s_version: str) -> Path:
    return cache_root() / f"k8s-{k8s_version}-etcd-{ETCD_VERSION}" / "bin"


def find_cached() -> Path | None:
    """The newest cached build that has every binary, if any."""
    for version in KUBERNETES_VERSIONS:
        d = bin_dir(version)
        if all((d / name).is_file() for name in BINARIES):
            return d
    return None


def helm_bin_dir() -> Path:
    return cache_root() / f"helm-{HELM_VERSION}" / "bin"


def find_helm() -> Path | None:
    """The cached helm binary, if built."""
    binary = helm_bin_dir() / "helm"
    return binary if binary.is_file() else None


def kueue_dir() -> Path:
    return cache_root() / f"kueue-{KUEUE_VERSION}"


def find_kueue() -> Path | None:
    """The cached Kueue controller, if built."""
    binary = kueue_dir() / "bin" / "kueue"
    return binary if binary.is_file() else None


def find_kueue_manifests() -> Path | None:
    """Kueue's release manifests (config/default built), if rendered."""
    path = kueue_dir() / "manifests" / "default.yaml"
    return path if path.is_file() else None


class GoMissing(RuntimeError):
    """No `go` command: no release can build, so there is nothing to fall back to."""


class GoFailed(RuntimeError):
    """A go command exited non-zero; the message carries the end of what it printed."""


def run_go(args: list[str], cwd: Path, env: dict[str, str], log, tail: int = 40) -> str:
    """Run `go args` in cwd and return its stdout; progress on stderr is echoed as it comes.

    On failure the raised GoFailed keeps the last `tail` lines of stderr (missing modules,
    compile errors), which is what the user needs to see.
    """
    log(f"$ go {' '.join(args)}  (in {cwd})")
    # stdout to a file, stderr read line by line: neither pipe can fill up and block go
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(["go", *args], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.PIPE, text=True, errors="replace")
        except FileNotFoundError:
            raise GoMissing("Go >= 1.26 is required to build the control plane; install it or set "
                            "TESSERA_BIN_DIR to a directory holding its binaries"
                            ) from None
        last: deque[str] = deque(maxlen=tail)
        with proc:
            for line in proc.stderr:
                sys.stderr.write(line)
                last.append(line.rstrip("\n"))
        out.seek(0)
        stdout = out.read().decode(errors="replace")
    if proc.returncode != 0:
        # `go mod download -json` reports its errors in the JSON on stdout, not on stderr
        said = [*last, *stdout.splitlines()[-tail:]]
        raise GoFailed(f"`go {' '.join(args)}` exited with status {proc.returncode}:\n"
                       + "\n".join(said))
    return stdout


def _go(args: list[str], cwd: Path, log) -> None:
    env = dict(os.environ, GOFLAGS="-mod=mod", CGO_ENABLED="0", GOTOOLCHAIN="local")
    run_go(args, cwd, env, log)


def staging_modules(k8s_version: str, workdir: Path, log) -> list[str]:
    """Names of the staging modules the given Kubernetes release replaces locally."""
    out = run_go(["mod", "download", "-json", f"k8s.io/kubernetes@{k8s_version}"], workdir,
                 dict(os.environ, GOTOOLCHAIN="local"), log)
    gomod = Path(json.loads(out)["GoMod"]).read_text()
    names = _STAGING_REPLACE.findall(gomod)
    log(f"k8s.io/kubernetes {k8s_version}: {len(names)} staging modules")
    return names


def write_module(k8s_version: str, workdir: Path, log) -> None:
    staging_version = "v0." + k8s_version.removeprefix("v1.")
    names = staging_modules(k8s_version, workdir, log)
    lines = [
        "module tessera.dev/controlplane",
        "",
        "go 1.26",
        "",
        "require (",
        f"\tk8s.io/kubernetes {k8s_version}",
        f"\tgo.etcd.io/etcd/server/v3 {ETCD_VERSION}",
        ")",
        "",
        "replace (",
        *[f"\t{name} => {name} {staging_version}" for name in names],
        ")",
        "",
    ]
    (workdir / "go.mod").write_text("\n".join(lines))
    # Blank imports keep every main package in the module graph for `go mod tidy`.
    imports = [*(f"k8s.io/kubernetes/cmd/{c}" for c in KUBERNETES_COMMANDS),
               "go.etcd.io/etcd/server/v3"]
    (workdir / "tools.go").write_text(
        "//go:build tools\n\npackage tools\n\nimport (\n"
        + "".join(f'\t_ "{i}"\n' for i in imports) + ")\n")


def _version_ldflags(k8s_version: str) -> str:
    """Stamp the release into the binary, as the Kubernetes build does, so /version is truthful."""
    major, minor, _ = k8s_version.removeprefix("v").split(".")
    pkg = "k8s.io/component-base/version"
    return (f"-X {pkg}.gitVersion={k8s_version} -X {pkg}.gitMajor={major} "
            f"-X {pkg}.gitMinor={minor} -X {pkg}.gitTreeState=clean")


def build(k8s_version: str, log=print) -> Path:
    out = bin_dir(k8s_version)
    with tempfile.TemporaryDirectory(prefix="tessera-cp-") as tmp:
        work = Path(tmp)
        # 1. a throwaway module that pins the release and its staging modules
        write_module(k8s_version, work, log)
        _go(["mod", "tidy", "-e"], work, log)
        # 2. build every binary into a staging dir, then move into the cache atomically;
        #    one `go build` of several mains into a folder compiles the shared tree once
        stage = work / "bin"
        stage.mkdir()
        ldflags = f"-ldflags=-s -w {_version_ldflags(k8s_version)}"
        _go(["build", "-trimpath", ldflags, "-o", f"{stage}/",
             *(f"k8s.io/kubernetes/cmd/{c}" for c in KUBERNETES_COMMANDS)], work, log)
        _go(["build", "-trimpath", "-ldflags=-s -w", "-o", str(stage / "etcd"),
             "go.etcd.io/etcd/server/v3"], work, log)
        _into_cache(stage, out)
    return out


def _into_cache(stage: Path, out: Path) -> None:
    """Move the folder `stage` to `out` so that `out` appears whole or not at all: a killed build
    never looks cached."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(stage, partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def _go_install(target: str, ldflags: str, out: Path, log) -> None:
    """`go install target` (module/cmd@version, built as released) into the cache folder `out`."""
    with tempfile.TemporaryDirectory(prefix="tessera-go-install-") as tmp:
        stage = Path(tmp) / "bin"
        run_go(["install", "-trimpath", f"-ldflags=-s -w {ldflags}", target], Path(tmp),
               dict(os.environ, GOBIN=str(stage), CGO_ENABLED="0", GOTOOLCHAIN="local"), log)
        _into_cache(stage, out)


def build_helm(log=print) -> Path:
    # helm reports the version stamped here; unstamped it says only the minor
    _go_install(f"{HELM_MODULE}/cmd/helm@{HELM_VERSION}",
                f"-X {HELM_MODULE}/internal/version.version={HELM_VERSION}", helm_bin_dir(), log)
    return helm_bin_dir() / "helm"


def build_kueue(log=print) -> Path:
    # stamped, so that its log and metrics name the release
    _go_install(f"{KUEUE_MODULE}/cmd/kueue@{KUEUE_VERSION}",
                f"-X {KUEUE_MODULE}/pkg/version.GitVersion={KUEUE_VERSION}",
                kueue_dir() / "bin", log)
    return kueue_dir() / "bin" / "kueue"


def render_kueue_manifests(log=print) -> Path:
    """Kueue's release manifests as `kubectl kustomize config/default` builds them from its
    module (downloaded into the Go module cache once, read from there afterwards)."""
    out = run_go(["mod", "download", "-json", f"{KUEUE_MODULE}@{KUEUE_VERSION}"],
                 cache_root(), dict(os.environ, GOTOOLCHAIN="local"), log)
    source = Path(json.loads(out)["Dir"]) / KUEUE_MANIFESTS
    built = subprocess.run(["kubectl", "kustomize", str(source)], capture_output=True,
                           text=True, timeout=600)
    if built.returncode != 0:
        raise GoFailed(f"`kubectl kustomize {source}` exited with status {built.returncode}:\n"
                       + built.stderr[-4000:])
    with tempfile.TemporaryDirectory(prefix="tessera-kueue-manifests-") as tmp:
        (Path(tmp) / "default.yaml").write_text(built.stdout)
        _into_cache(Path(tmp), kueue_dir() / "manifests")
    return kueue_dir() / "manifests" / "default.yaml"


def _cached_or_built(find: Callable[[], Path | None], build: Callable[[], Path]) -> Path:
    """What `find` finds in the cache, else what `build` makes. Concurrent callers (parallel test
    sessions, `tessera-dev up`) serialize on a lock file, so only the first builds and the rest
    find its result in the cache."""
    cached = find()
    if cached:
        return cached
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return find() or build()


def ensure_helm(log=print) -> Path:
    """The helm binary, built on first use."""
    return _cached_or_built(find_helm, lambda: build_helm(log))


def ensure_kueue(log=print) -> Path:
    """Kueue's controller, built on first use (many minutes)."""
    return _cached_or_built(find_kueue, lambda: build_kueue(log))


def ensure_kueue_manifests(log=print) -> Path:
    """Kueue's release manifests, rendered on first use."""
    return _cached_or_built(find_kueue_manifests, lambda: render_kueue_manifests(log))


def ensure(log=print) -> Path:
    """Return the directory holding the control-plane binaries, building them on first use."""
    return _cached_or_built(find_cached, lambda: _build_newest_that_works(log))


def _build_newest_that_works(log) -> Path:
    errors = []
    for version in KUBERNETES_VERSIONS:
        try:
            return build(version, log)
        except GoFailed as exc:
            errors.append(f"{version}: {exc}")
            log(f"building Kubernetes {version} failed; trying an earlier minor")
    raise RuntimeError(
        "no Kubernetes release built from the module registry:\n" + "\n".join(errors))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-dev build-controlplane", description=__doc__)
    parser.add_argument("--kueue", action="store_true",
                        help=f"also Kueue {KUEUE_VERSION}'s controller and its manifests "
                             "(`tessera-dev up --kueue`, the tests marked kueue)")
    args = parser.parse_args(argv)
    try:
        print(ensure())
        print(ensure_helm())
        if args.kueue:
            print(ensure_kueue())
            print(ensure_kueue_manifests())
    except RuntimeError as exc:  # GoMissing, or every release failed: the message says why
        print(f"tessera-dev build-controlplane: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
