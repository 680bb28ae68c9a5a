"""The per-wheel CI jobs (.github/workflows/ci.yml, job `package`) test every workspace member,
each in a tests folder that exists and holds tests, with an extra the member declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"


def matrix_rows() -> list[dict[str, Any]]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    return list(workflow["jobs"]["package"]["strategy"]["matrix"]["include"])


def test_every_workspace_member_has_exactly_one_ci_row(members):
    packages = [row["package"] for row in matrix_rows()]

    assert sorted(packages) == sorted(m.name for m in members)


@pytest.mark.parametrize("row", matrix_rows(), ids=lambda row: row["package"])
def test_ci_row_tests_folder_exists_and_holds_tests(row):
    folder = ROOT / row["tests"]

    assert folder.is_dir(), f"{row['tests']} does not exist"
    assert sorted(folder.glob("test_*.py")), f"{row['tests']} has no test_*.py"


@pytest.mark.parametrize("row", matrix_rows(), ids=lambda row: row["package"])
def test_ci_row_extra_is_declared_by_its_member(row, members):
    [member] = [m for m in members if m.name == row["package"]]

    assert row.get("extras", "") in {"", *member.extras}


@pytest.mark.parametrize("row", matrix_rows(), ids=lambda row: row["package"])
def test_ci_row_of_a_member_with_extras_installs_one(row, members):
    # The optional dependencies are what a member's own tests exercise (neural-compressor for
    # INC FP8, nixl for the connectors); a job without them would skip those tests.
    [member] = [m for m in members if m.name == row["package"]]

    assert not member.extras or row.get("extras") in member.extras
