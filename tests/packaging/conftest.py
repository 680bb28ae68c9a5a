"""The workspace members as built wheels, and clean venvs holding one wheel each.

`member` parametrizes a test over the workspace members, `sibling` over all but the platform; both
are read from the root pyproject, so a new member is tested without editing anything here. The
wheels are built once per session.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest
import tomllib
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "testkit"  # gaudi_testkit: never published, see its README
PLATFORM = "vllm-gaudi-platform"
# The one version of the four wheels; every member's pyproject reads it (`[tool.hatch.version]`).
VERSION_FILE = ROOT / "packages" / PLATFORM / "src" / "vllm_gaudi_platform" / "version.py"
# Where torch's "+cpu" builds live when pip has no local wheel store configured.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Scripts entries in pyproject become these entry_points.txt groups.
SCRIPT_GROUPS = {"scripts": "console_scripts", "gui-scripts": "gui_scripts"}


@dataclass(frozen=True)
class Member:
    """One workspace member as its pyproject declares it."""

    name: str
    version: str  # as built: read from the file its `[tool.hatch.version] path` names
    path: Path
    version_file: Path | None
    import_name: str
    dependencies: tuple[str, ...]
    extras: tuple[str, ...]  # its optional-dependencies names
    entry_points: dict[str, dict[str, str]] = field(hash=False)

    def __str__(self) -> str:
        return self.name


def read_version(path: Path) -> str:
    """The `__version__ = "..."` of a version file, as hatch's default pattern reads it."""
    match = re.search(r'^__version__ = "([^"]+)"$', path.read_text(), re.MULTILINE)
    if match is None:
        pytest.fail(f'{path} has no __version__ = "..." line')
    return match.group(1)


def _load_member(path: Path) -> Member:
    pyproject = tomllib.loads((path / "pyproject.toml").read_text())
    project = pyproject["project"]
    version_file = None
    if "version" in project.get("dynamic", ()):
        version_file = (path / pyproject["tool"]["hatch"]["version"]["path"]).resolve()
        version = read_version(version_file)
    else:
        version = project["version"]
    [package] = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    entry_points = {group: dict(eps) for group, eps in project.get("entry-points", {}).items()}
    for key, group in SCRIPT_GROUPS.items():
        if project.get(key):
            entry_points[group] = dict(project[key])
    return Member(
        name=canonicalize_name(project["name"]),
        version=version,
        path=path,
        version_file=version_file,
        import_name=Path(package).name,
        dependencies=tuple(project.get("dependencies", ())),
        extras=tuple(project.get("optional-dependencies", {})),
        entry_points=entry_points,
    )


def workspace_members() -> list[Member]:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [_load_member(ROOT / member) for member in root["tool"]["uv"]["workspace"]["members"]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    members = workspace_members()
    if "member" in metafunc.fixturenames:
        metafunc.parametrize("member", members, ids=[m.name for m in members])
    if "sibling" in metafunc.fixturenames:
        siblings = [m for m in members if m.name != PLATFORM]
        metafunc.parametrize("sibling", siblings, ids=[m.name for m in siblings])
    if "plugin_sibling" in metafunc.fixturenames:
        # Only siblings that declare general plugins; the others have nothing to register.
        with_plugins = [
            m for m in members if m.name != PLATFORM and m.entry_points.get("vllm.general_plugins")
        ]
        metafunc.parametrize("plugin_sibling", with_plugins, ids=[m.name for m in with_plugins])


@pytest.fixture(scope="session")
def members() -> list[Member]:
    return workspace_members()


@pytest.fixture(scope="session")
def version_file() -> Path:
    """The one version file of the four wheels."""
    return VERSION_FILE.resolve()


@pytest.fixture(scope="session")
def one_version() -> str:
    """The version the four wheels share, as written in the version file."""
    return read_version(VERSION_FILE)


@pytest.fixture(scope="session")
def uv() -> str:
    path = shutil.which("uv")
    if path is None:
        pytest.fail("uv is not on PATH; `make setup` installs it")
    return path


def uv_env(**overrides: str) -> dict[str, str]:
    """The environment for uv: no inherited index settings unless passed in `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV"))}
    env.update(overrides)
    return env


def run_uv(uv: str, *args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [uv, *args], env=env or uv_env(), capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"uv {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


@dataclass(frozen=True)
class Wheel:
    path: Path

    def _zip(self) -> zipfile.ZipFile:
        return zipfile.ZipFile(self.path)

    def names(self) -> list[str]:
        with self._zip() as z:
            return z.namelist()

    def read(self, suffix: str) -> str:
        with self._zip() as z:
            [name] = [n for n in z.namelist() if n.endswith(f".dist-info/{suffix}")]
            return z.read(name).decode()

    def metadata(self) -> Message:
        return Parser().parsestr(self.read("METADATA"))


@pytest.fixture(scope="session")
def dist_dir(uv: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`uv build --all-packages` into a fresh folder, once per session."""
    out = tmp_path_factory.mktemp("dist")
    run_uv(uv, "build", "--all-packages", "--out-dir", str(out), "--directory", str(ROOT))
    return out


@pytest.fixture(scope="session")
def wheels(dist_dir: Path) -> dict[str, Wheel]:
    """Built wheels by distribution name."""
    found = {}
    for path in sorted(dist_dir.glob("*.whl")):
        found[canonicalize_name(path.name.split("-")[0])] = Wheel(path)
    return found


# --- clean venvs: the CPU engine plus one wheel ------------------------------------------------


def _pip_find_links() -> list[str]:
    """pip's configured find-links (a local wheel store), if any; uv does not read pip's config."""
    for python in (sys.executable, shutil.which("python3")):
        if not python:
            continue
        result = subprocess.run(
            [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
        )
        for line in result.stdout.splitlines():
            match = re.match(r"^[\w:.-]*find-links='(.*)'$", line.strip())
            if match:
                return match.group(1).split()
    return []


def engine_source_args() -> tuple[list[str], dict[str, str]]:
    """uv arguments and environment that find the CPU engine (torch "+cpu" is not on PyPI)."""
    if os.environ.get("UV_FIND_LINKS"):
        return [], {"UV_FIND_LINKS": os.environ["UV_FIND_LINKS"]}
    links = _pip_find_links()
    if links:
        return [arg for link in links for arg in ("--find-links", link)], {}
    return [], {"UV_EXTRA_INDEX_URL": TORCH_CPU_INDEX, "UV_INDEX_STRATEGY": "unsafe-best-match"}


def _dev_only(root_pyproject: dict, installed: dict[str, list[str]]) -> set[str]:
    """Dev-group tools that no other installed distribution requires (tqdm is vLLM's too)."""
    dev = {
        canonicalize_name(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0])
        for req in root_pyproject.get("dependency-groups", {}).get("dev", [])
    }
    needed = {
        canonicalize_name(re.split(r"[<>=!~;\[ (]", req, maxsplit=1)[0])
        for name, requires in installed.items()
        if name not in dev
        for req in requires
    }
    return dev - needed


@pytest.fixture(scope="session")
def engine_requirements(uv: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dev venv's frozen packages minus the workspace members and dev-only tools.

    Installing exactly these pins with --no-deps gives a clean venv the same CPU engine as the dev
    venv, hard-linked from uv's cache: seconds, not minutes.
    """
    from importlib import metadata

    installed = {
        canonicalize_name(d.metadata["Name"]): list(d.requires or [])
        for d in metadata.distributions()
        if d.metadata["Name"]
    }
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    drop = _dev_only(root, installed) | {m.name for m in workspace_members()}
    frozen = run_uv(uv, "pip", "freeze", "--python", sys.executable)
    keep = []
    for line in frozen.splitlines():
        name = canonicalize_name(re.split(r"==| @ ", line, maxsplit=1)[0])
        if line.startswith("-e ") or name in drop or name.startswith("vllm-gaudi-"):
            continue
        keep.append(line)
    path = tmp_path_factory.mktemp("engine") / "engine.txt"
    path.write_text("\n".join(keep) + "\n")
    return path


@dataclass(frozen=True)
class IsolatedVenv:
    member: Member
    path: Path

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")


@pytest.fixture(scope="session")
def isolated_venv(uv, dist_dir, engine_requirements, tmp_path_factory):
    """`isolated_venv(member) -> IsolatedVenv`: the CPU engine plus `member` from the built wheels.

    The wheel is resolved with --no-index from the built wheels only, so its declared sibling
    dependencies come from this build and never from a same-named package on PyPI; its other
    dependencies must already be satisfied by the engine.
    """
    cache: dict[str, IsolatedVenv] = {}

    def make(member: Member) -> IsolatedVenv:
        if member.name in cache:
            return cache[member.name]
        path = tmp_path_factory.mktemp(f"venv-{member.name}")
        run_uv(uv, "venv", "--quiet", "--python", sys.executable, str(path / "v"))
        venv = IsolatedVenv(member, path / "v")
        source_args, source_env = engine_source_args()
        run_uv(
            uv,
            "pip",
            "install",
            "--quiet",
            # The root pyproject overrides torch away for the lock (the nixl extra); the engine
            # install must not see that override.
            "--no-config",
            "--python",
            venv.python,
            "--no-deps",
            *source_args,
            "-r",
            str(engine_requirements),
            env=uv_env(**source_env),
        )
        # The CI machines' torchvision hook, as in the dev venv (testkit/: where torchvision is a
        # CUDA build beside the CPU torch, vLLM's import fails without it). No wheel carries it;
        # test_house checks that no wheel imports the kit.
        run_uv(uv, "pip", "install", "--quiet", "--python", venv.python, "--no-deps", str(KIT))
        run_uv(
            uv,
            "pip",
            "install",
            "--quiet",
            "--python",
            venv.python,
            "--no-index",
            "--find-links",
            str(dist_dir),
            f"{member.name}=={member.version}",
        )
        cache[member.name] = venv
        return venv

    return make
