"""Each process installs from the project's wheel with its own extra alone, as its image does
(constraints/ pinning the rest): the operator and the node agents without torch, their commands,
modules and CRDs working from site-packages; a plain install (no extra) runs the user's command
line, `kubectl ntp` against a real API server; and the Dockerfile's images install the same wheel
with the same extras and constraints."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tessera_contracts.api import GROUP, JOB_PLURAL, VERSION
from tessera_dev import imagesize, lock, paths
from tessera_dev.controlplane import launcher
from tessera_dev.simnode import images

# the installs download from the package index on a loaded 2-core machine
pytestmark = [pytest.mark.packaging, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
RUN_TIMEOUT_S = 300

CRD_KINDS = {"NTPTrainingJob", "GPUPowerTarget", "GPUHealth"}
# per extra: the `tessera` commands its image runs, and the modules those commands load
COMMANDS = {
    "operator": [["operator"]],
    "agent": [["power-agent"], ["health-agent"]],
}
MODULES = {
    "operator": ["tessera_operator.handlers"],
    "agent": ["tessera_agents.power.main", "tessera_agents.health.main"],
}

# every file the contracts open while loading the CRDs, seen through the interpreter's own
# audit events rather than recomputed from the package's layout
CRD_PROBE = """
import json, sys, sysconfig
opened = []
sys.addaudithook(lambda event, args: event == "open" and opened.append(str(args[0])))
from tessera_contracts import api
kinds = [crd["spec"]["names"]["kind"] for crd in api.crd_documents()]
print(json.dumps({"kinds": kinds, "site": sysconfig.get_paths()["purelib"],
                  "read": [path for path in opened if path.endswith(".yaml")]}))
"""


@dataclass(frozen=True)
class Venv:
    extra: str
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def run(self, *argv: str | Path) -> subprocess.CompletedProcess[str]:
        """`argv` with this environment's binaries, outside the repository and with nothing of
        the test's own environment on the import path."""
        return subprocess.run([str(arg) for arg in argv], cwd=self.root,
                              env=imagesize.isolated_env(self.bin),
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run(self.bin / "python", "-c", code)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = imagesize.build_wheel(tmp_path_factory.mktemp("wheel"))
    print(f"\nwheel {built.name}: {built.stat().st_size / 1e3:.0f} kB")
    return built


@pytest.fixture(scope="module")
def venvs(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Venv]]:
    """A fresh virtual environment per extra with what its image installs: the wheel, the extra,
    its constraints (from PyPI; uv's cache makes reruns fast). Installed side by side: uv
    waits on the index and the disk as much as on a core."""
    def made(extra: str) -> Venv:
        env = Venv(extra, tmp_path_factory.mktemp(f"venv-{extra}"))
        added, _ = imagesize.install(env.root, wheel, extra)
        installed = sorted(imagesize.check(env.run(env.bin / "python", "-m", "pip", "list",
                                                   "--format=freeze")).split())
        print(f"\n[{extra}] installed: {added / 1e6:.1f} MB, "
              f"{len(installed)} distributions: {' '.join(installed)}")
        return env

    with ThreadPoolExecutor(len(COMMANDS)) as pool:
        built = dict(zip(sorted(COMMANDS), pool.map(made, sorted(COMMANDS)), strict=True))
    yield built
    for env in built.values():
        shutil.rmtree(env.root)


@pytest.fixture(params=sorted(COMMANDS))
def venv(request: pytest.FixtureRequest, venvs: dict[str, Venv]) -> Venv:
    return venvs[request.param]


@pytest.fixture(scope="module")
def plain(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    """`pip install tessera` with no extra: the base dependencies alone."""
    env = Venv("", tmp_path_factory.mktemp("venv-plain"))
    added, _ = imagesize.install(env.root, wheel, None)
    print(f"\n[plain] installed: {added / 1e6:.1f} MB")
    yield env
    shutil.rmtree(env.root)


def test_a_plain_install_runs_kubectl_ntp_against_a_real_api_server(
        plain: Venv, admin_api, namespace: str, tessera_crds: list[str],
        control_plane: launcher.ControlPlane) -> None:
    """The user's command line from a plain install: kubectl finds the plugin, which reads a
    job's status from the API server; no process extra, torch or kopf came with it."""
    for module in (*lock.HEAVY, "kopf", "prometheus_client"):
        done = plain.python(f"import {module}")
        assert f"No module named '{module}'" in done.stderr, (module, done.stderr)
    name = "plain-install"
    example = yaml.safe_load((REPO / "manifests/examples/ntpjob-small.yaml").read_text())
    client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, JOB_PLURAL, example | {"metadata": {"name": name}})
    assert imagesize.check(plain.run("kubectl", "ntp", "--help")).startswith(
        "usage: kubectl ntp COMMAND")
    shown = imagesize.check(plain.run("kubectl", "ntp", "status", name, "-n", namespace,
                                      "--kubeconfig", control_plane.kubeconfig))
    assert shown.startswith(f"NTPTrainingJob {namespace}/{name}: no status yet"), shown
    for command in (["cordon-gpu"], ["uncordon-gpu"], ["uninstall"]):
        assert "usage:" in imagesize.check(plain.run(plain.bin / "tessera", *command, "--help"))


def test_torch_and_the_simulators_libraries_are_absent(venv: Venv) -> None:
    for module in lock.HEAVY:
        done = venv.python(f"import {module}")
        assert done.returncode != 0 and f"No module named '{module}'" in done.stderr, (
            f"`import {module}` in the {venv.extra} environment: exit {done.returncode}\n"
            f"{done.stderr}")


def test_version(venv: Venv) -> None:
    assert imagesize.check(venv.run(venv.bin / "tessera", "--version")).strip() == (
        f"tessera {PROJECT['version']}")


def test_the_extras_commands_answer_help(venv: Venv) -> None:
    for command in COMMANDS[venv.extra]:
        assert "usage:" in imagesize.check(venv.run(venv.bin / "tessera", *command, "--help"))


def test_the_process_modules_import(venv: Venv) -> None:
    imagesize.check(venv.python("import " + ", ".join(MODULES[venv.extra])))


def test_crds_load_from_the_installed_package_data(venv: Venv) -> None:
    probe = json.loads(imagesize.check(venv.python(CRD_PROBE)))
    site = Path(probe["site"]).resolve()
    assert site == imagesize.site_packages(venv.root).resolve()
    assert set(probe["kinds"]) == CRD_KINDS and len(probe["kinds"]) == len(CRD_KINDS)
    read = [Path(path).resolve() for path in probe["read"]]
    assert len(read) == len(CRD_KINDS), probe["read"]
    for path in read:
        assert path.is_relative_to(site / "tessera_contracts" / "crds"), path
        assert not path.is_relative_to(REPO), path


# --- the Dockerfile: no engine here, so its text is checked, and its one script is run ---

# image target -> (the extra it installs, whether it runs as root)
TARGETS = {target: (extra, target == "power-agent") for target, extra in lock.IMAGES.items()}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def dockerfile_stages() -> dict[str, tuple[str, list[Instruction]]]:
    """Each stage's name -> (what it is FROM, its instructions), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: dict[str, tuple[str, list[Instruction]]] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, args = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            image, name = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args.strip(),
                                       re.IGNORECASE).groups()
            instructions: list[Instruction] = []
            stages[name or image] = (image, instructions)
        else:
            instructions.append(Instruction(keyword.upper(), args.strip()))
    return stages


def lineage(stages: dict[str, tuple[str, list[Instruction]]],
            target: str) -> list[Instruction]:
    """A target's instructions in build order, those of the stages it is built FROM first."""
    parent, own = stages[target]
    return (lineage(stages, parent) if parent in stages else []) + own


def pip_installs(instructions: list[Instruction]) -> list[list[str]]:
    return [shlex.split(instruction.args) for instruction in instructions
            if instruction.keyword == "RUN" and "pip install" in instruction.args]


def built_images() -> dict[str, str]:
    """Each target -> the image repository the Dockerfile's build commands tag it as."""
    commands = re.findall(r"docker build --target (\S+) -t (\S+)",
                          (REPO / "Dockerfile").read_text())
    return {target: images.repository(tag) for target, tag in commands}


def test_each_image_installs_its_own_extra_dependencies_first() -> None:
    stages = dockerfile_stages()
    tagged = built_images()
    assert set(tagged) == set(TARGETS) and set(tagged.values()) == set(images.ENTRYPOINTS)
    for target, (extra, root) in TARGETS.items():
        build = lineage(stages, target)
        installs = pip_installs(build)
        pinned = f"constraints/{extra}.txt"
        assert installs == [["pip", "install", "-r", f"requirements-{extra}.txt", "-c", pinned],
                            ["pip", "install", "--no-deps", "/wheels/*.whl"]], (target, installs)
        deps_at = build.index(Instruction("RUN", shlex.join(installs[0])))
        # only the metadata and the extra's pins are in the image when the dependencies install
        copied = [step.args for step in build[:deps_at] if step.keyword in ("COPY", "ADD")]
        assert copied == ["pyproject.toml ./", f"{pinned} constraints/"], (target, copied)
        assert [step.args for step in build[deps_at:] if step.keyword in ("COPY", "ADD")] == [
            "--from=wheel /wheels/ /wheels/"], target
        [entry] = [step.args for step in build if step.keyword == "ENTRYPOINT"]
        # what the simulated nodes run in the image's place
        assert tuple(json.loads(entry)) == images.ENTRYPOINTS[tagged[target]], target
        users = [step.args for step in build if step.keyword == "USER"]
        assert users == ([] if root else ["65532"]), (target, users)


def test_no_image_installs_the_project_editable() -> None:
    for _, instructions in dockerfile_stages().values():
        for argv in pip_installs(instructions):
            assert not {"-e", "--editable"} & set(argv), argv


def test_the_wheel_stage_builds_from_the_source_alone() -> None:
    _, wheel_stage = dockerfile_stages()["wheel"]
    steps = [(step.keyword, step.args) for step in wheel_stage]
    assert steps[-1] == ("RUN", "pip wheel --no-deps -w /wheels ."), steps
    assert sorted(steps[:-1]) == sorted(("COPY", f"{d}/ {d}/") for d in paths.source_folders(REPO))


def test_the_requirements_files_are_the_extras_of_pyproject(tmp_path: Path) -> None:
    """The base stage's script, run as the image runs it, writes each extra's requirements: the
    base dependencies and that extra's pins."""
    _, base = dockerfile_stages()["base"]
    [script] = [step.args for step in base if "requirements-" in step.args]
    shutil.copy2(REPO / "pyproject.toml", tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    imagesize.check(subprocess.run(["sh", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S))
    for extra, _ in TARGETS.values():
        written = (tmp_path / f"requirements-{extra}.txt").read_text().splitlines()
        assert written == lock.requirements(extra, REPO)


def test_the_build_context_holds_what_the_images_copy_and_nothing_else() -> None:
    """.dockerignore lets in pyproject.toml, constraints/ and the source folders (less caches and
    build metadata): the virtual environment, tests, docs and git stay out."""
    rules = [line for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", rules
    assert {rule for rule in rules if rule.startswith("!")} == {
        "!pyproject.toml", "!constraints/", *(f"!{d}/" for d in paths.source_folders(REPO))}
    copied = {step.args.split()[0].split("/")[0] for _, stage in dockerfile_stages().values()
              for step in stage if step.keyword == "COPY" and "--from" not in step.args}
    assert copied == {"pyproject.toml", "constraints", *paths.source_folders(REPO)}


def test_the_health_agent_runs_in_the_power_agent_image() -> None:
    daemonset = yaml.safe_load((REPO / "manifests/power-controller/daemonset.yaml").read_text())
    containers = {c["name"]: c for c in daemonset["spec"]["template"]["spec"]["containers"]}
    assert containers["health"]["image"] == containers["agent"]["image"]
    assert containers["health"]["command"] == ["tessera", "health-agent"]
    # the agent container relies on the image's entry point
    assert "command" not in containers["agent"]
