"""The README's settings and entry-point tables say what the code does: every variable of
`envs.VARIABLES` (and no other) with its default, and every plugin entry point of every member's
pyproject (the built wheels' entry points are checked against the pyprojects in
tests/packaging) with its group and wheel."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import tomllib

from vllm_gaudi_platform import envs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DERIVED = "derived from the engine limits"


def table_after(heading: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule dropped) of the first table after `heading`."""
    lines = README.read_text().splitlines()
    start = lines.index(heading)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    if len(rows) < 2:
        pytest.fail(f"README.md has no table under {heading!r}")
    return rows[2:]


def unquote(cell: str) -> str:
    match = re.fullmatch(r"`([^`]*)`", cell)
    return match.group(1) if match else cell


def expand(pattern: str) -> list[str]:
    """`A_{X,Y}_B` -> [A_X_B, A_Y_B]; several brace groups give every combination."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def settings_rows() -> dict[str, str]:
    """README variable name -> its default cell, brace patterns expanded."""
    documented: dict[str, str] = {}
    for name_cell, default, _meaning in table_after("### Settings"):
        for name in expand(unquote(name_cell)):
            assert name not in documented, f"{name} is listed twice in README.md"
            documented[name] = default
    return documented


def test_expand_spells_every_combination():
    assert expand("V_{A,B}_X_{1,2}") == ["V_A_X_1", "V_A_X_2", "V_B_X_1", "V_B_X_2"]


def test_readme_settings_table_lists_exactly_the_declared_variables():
    documented = set(settings_rows())

    assert sorted(documented - set(envs.VARIABLES)) == [], "in README.md but not in envs.py"
    assert sorted(set(envs.VARIABLES) - documented) == [], "in envs.py but not in README.md"


def test_readme_settings_table_gives_each_declared_default():
    wrong = {}
    for name, cell in settings_rows().items():
        default = envs.VARIABLES[name].default
        expected = {"unset", DERIVED} if default is None else {f"`{default}`"}
        if cell not in expected:
            wrong[name] = (cell, default)

    assert wrong == {}


def test_every_declared_variable_has_a_known_kind_and_a_meaning():
    assert [v.name for v in envs.VARIABLES.values() if v.kind not in envs.KINDS] == []
    assert [v.name for v in envs.VARIABLES.values() if len(v.doc) < 20] == []


def plugin_entry_points() -> set[tuple[str, str, str]]:
    """(name, group, wheel) of every vllm.* entry point in the workspace members' pyprojects."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = set()
    for member in root["tool"]["uv"]["workspace"]["members"]:
        project = tomllib.loads((ROOT / member / "pyproject.toml").read_text())["project"]
        for group, eps in project.get("entry-points", {}).items():
            if group.startswith("vllm."):
                found |= {(name, group, project["name"]) for name in eps}
    return found


def test_readme_entry_point_table_matches_the_members_entry_points():
    rows = table_after("## Entry points")
    documented = {(unquote(name), unquote(group), wheel) for name, group, wheel, _ in rows}

    assert documented == plugin_entry_points()
