"""seam/gaudi/ is executed by the tests, not only type-checked: at least 90% of its lines run
in the tests marked `gaudi` (over the Habana stand-in off Gaudi), measured with coverage.py in a
fresh interpreter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

MIN_PERCENT = 90.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The test files that mark tests `gaudi` (pytest.mark.gaudi, not gaudi_device): collecting only
# them spares the run the imports of every other test module (vLLM, transformers, ray, INC).
MARKER = re.compile(r"pytest\.mark\.gaudi\b(?!_)")


def _marked_files() -> list[str]:
    tests = Path(ROOT, "tests")
    files = [str(p) for p in sorted(tests.rglob("test_*.py")) if MARKER.search(p.read_text())]
    assert files, "no test file marks tests gaudi"
    return files


@pytest.mark.process
@pytest.mark.timeout(600)
def test_the_gaudi_tests_execute_at_least_90_percent_of_the_gaudi_backend(tmp_path, clean_env):
    data = tmp_path / "coverage.data"
    env = clean_env({"COVERAGE_FILE": str(data)})
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "coverage",
            "run",
            "--include=*/vllm_gaudi_platform/seam/gaudi/*.py",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gaudi and not engine",
            *_marked_files(),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = tmp_path / "coverage.json"
    subprocess.run(
        [sys.executable, "-m", "coverage", "json", "-o", str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        check=True,
    )
    files = json.loads(report.read_text())["files"]
    backend = {n: f for n, f in files.items() if "seam/gaudi/" in n}
    assert backend, f"coverage saw no module of seam/gaudi/: {sorted(files)}"
    statements = sum(f["summary"]["num_statements"] for f in backend.values())
    missing = sum(f["summary"]["missing_lines"] for f in backend.values())
    percent = 100.0 * (statements - missing) / statements
    assert percent >= MIN_PERCENT, (
        f"seam/gaudi/: {percent:.1f}% of lines run by the gaudi tests; missing lines "
        + "; ".join(f"{n}: {f['missing_lines']}" for n, f in backend.items() if f["missing_lines"])
    )
