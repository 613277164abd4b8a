"""Each process installs from the project's wheel with its own extra alone: the operator and the
node agents without torch, their commands, modules and CRDs working from site-packages; and the
Dockerfile's images install the same wheel with the same extras."""

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
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tessera_dev.simnode import images

# pip resolves and downloads on a loaded 2-core machine: the first install takes minutes
pytestmark = [pytest.mark.packaging, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
INSTALL_TIMEOUT_S = 1500
RUN_TIMEOUT_S = 300

# what only the trainer and the simulator may pull in
HEAVY_MODULES = ("torch", "triton", "matplotlib", "numpy")
CRD_KINDS = {"NTPTrainingJob", "GPUPowerTarget", "GPUHealth"}
# per extra: the `tessera` commands its image runs, and the modules those commands load
COMMANDS = {
    "operator": [["operator"]],
    "agent": [["power-agent"], ["health-agent"]],
}
MODULES = {
    "operator": ["tessera_operator.handlers"],
    "agent": ["tessera_agents.power.main", "tessera_agents.health.agent"],
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


def tree_size(root: Path) -> int:
    return sum(path.lstat().st_size for path in root.rglob("*") if not path.is_dir())


@dataclass(frozen=True)
class Venv:
    extra: str
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def site_packages(self) -> Path:
        # made by this interpreter's venv module, so of this interpreter's version
        major, minor = sys.version_info[:2]
        return self.root / f"lib/python{major}.{minor}/site-packages"

    def run(self, *argv: str | Path) -> subprocess.CompletedProcess[str]:
        """`argv` with this environment's binaries, outside the repository and with nothing of
        the test's own environment on the import path."""
        env = {name: value for name, value in os.environ.items()
               if name not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return subprocess.run([str(arg) for arg in argv], cwd=self.root, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run(self.bin / "python", "-c", code)


def check(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, (
        f"{shlex.join(done.args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once, from a copy of the project's metadata and source (an
    in-tree build would leave build/ in the shared working tree, and its stale files would ship)."""
    source = tmp_path_factory.mktemp("source")
    shutil.copy2(REPO / "pyproject.toml", source)
    shutil.copytree(REPO / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    check(subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                          "-w", str(out), str(source)],
                         capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S))
    [built] = out.glob("*.whl")
    print(f"\nwheel {built.name}: {built.stat().st_size / 1e3:.0f} kB")
    return built


@pytest.fixture(scope="module", params=sorted(COMMANDS))
def venv(request: pytest.FixtureRequest, wheel: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    """A fresh virtual environment with the wheel and one extra installed from PyPI (pip's cache
    makes reruns fast)."""
    extra: str = request.param
    root = tmp_path_factory.mktemp(f"venv-{extra}")
    check(subprocess.run([sys.executable, "-m", "venv", str(root)],
                         capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S))
    made = Venv(extra, root)
    check(made.run(made.bin / "python", "-m", "pip", "install", "--quiet", "--progress-bar", "off",
                   f"{wheel}[{extra}]"))
    installed = sorted(check(made.run(made.bin / "python", "-m", "pip", "list",
                                      "--format=freeze")).split())
    print(f"\n[{extra}] site-packages: {tree_size(made.site_packages) / 1e6:.1f} MB, "
          f"{len(installed)} distributions: {' '.join(installed)}")
    yield made
    shutil.rmtree(root)


def test_torch_and_the_simulators_libraries_are_absent(venv: Venv) -> None:
    for module in HEAVY_MODULES:
        done = venv.python(f"import {module}")
        assert done.returncode != 0 and f"No module named '{module}'" in done.stderr, (
            f"`import {module}` in the {venv.extra} environment: exit {done.returncode}\n"
            f"{done.stderr}")


def test_version(venv: Venv) -> None:
    assert check(venv.run(venv.bin / "tessera", "--version")).strip() == (
        f"tessera {PROJECT['version']}")


def test_the_extras_commands_answer_help(venv: Venv) -> None:
    for command in COMMANDS[venv.extra]:
        assert "usage:" in check(venv.run(venv.bin / "tessera", *command, "--help"))


def test_the_process_modules_import(venv: Venv) -> None:
    check(venv.python("import " + ", ".join(MODULES[venv.extra])))


def test_crds_load_from_the_installed_package_data(venv: Venv) -> None:
    probe = json.loads(check(venv.python(CRD_PROBE)))
    site = Path(probe["site"]).resolve()
    assert site == venv.site_packages.resolve()
    assert set(probe["kinds"]) == CRD_KINDS and len(probe["kinds"]) == len(CRD_KINDS)
    read = [Path(path).resolve() for path in probe["read"]]
    assert len(read) == len(CRD_KINDS), probe["read"]
    for path in read:
        assert path.is_relative_to(site / "tessera_contracts" / "crds"), path
        assert not path.is_relative_to(REPO), path


# --- the Dockerfile: no engine here, so its text is checked, and its one script is run ---

# image target -> (the extra it installs, whether it runs as root)
TARGETS = {"operator": ("operator", False), "power-agent": ("agent", True),
           "trainer": ("trainer", False)}


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
        assert installs == [["pip", "install", "-r", f"requirements-{extra}.txt"],
                            ["pip", "install", "--no-deps", "/wheels/*.whl"]], (target, installs)
        deps_at = build.index(Instruction("RUN", f"pip install -r requirements-{extra}.txt"))
        # only the metadata is in the image when the dependencies install
        copied = [step.args for step in build[:deps_at] if step.keyword in ("COPY", "ADD")]
        assert copied == ["pyproject.toml ./"], (target, copied)
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
    assert [(step.keyword, step.args) for step in wheel_stage] == [
        ("COPY", "src/ src/"), ("RUN", "pip wheel --no-deps -w /wheels .")]


def test_the_requirements_files_are_the_extras_of_pyproject(tmp_path: Path) -> None:
    """The base stage's script, run as the image runs it, writes each extra's requirements: the
    base dependencies and that extra's pins."""
    _, base = dockerfile_stages()["base"]
    [script] = [step.args for step in base if "requirements-" in step.args]
    shutil.copy2(REPO / "pyproject.toml", tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    check(subprocess.run(["sh", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S))
    for extra, _ in TARGETS.values():
        written = (tmp_path / f"requirements-{extra}.txt").read_text().splitlines()
        assert written == PROJECT["dependencies"] + PROJECT["optional-dependencies"][extra]


def test_the_health_agent_runs_in_the_power_agent_image() -> None:
    daemonset = yaml.safe_load((REPO / "manifests/power-controller/daemonset.yaml").read_text())
    containers = {c["name"]: c for c in daemonset["spec"]["template"]["spec"]["containers"]}
    assert containers["health"]["image"] == containers["agent"]["image"]
    assert containers["health"]["command"] == ["tessera", "health-agent"]
    # the agent container relies on the image's entry point
    assert "command" not in containers["agent"]
