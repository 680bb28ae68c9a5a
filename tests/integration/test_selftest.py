"""`vllm-gaudi selftest` as an operator runs it, engine included: in CPU emulation (no Gaudi, no
setting: it turns emulation on itself) and over the Habana stand-in (the Gaudi backend, an engine
on its "hpu" device). One selftest, so one engine, per backend; the report must be complete and
the engine's perplexity through the platform within its tolerance of transformers' on the host.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from vllm_gaudi_platform.commands import selftest, selftest_kernels, selftest_probes

pytestmark = pytest.mark.engine

BACKENDS = {
    "emulation": {"PT_HPU_LAZY_MODE": None},  # as a newcomer runs it: no setting at all
    "stand-in": {**STANDIN_ENGINE_ENV, "PT_HPU_LAZY_MODE": "1"},
}


@pytest.fixture(scope="module", params=list(BACKENDS))
def run(request, console_script, clean_env, tmp_path_factory):
    if request.param == "stand-in" and REAL_GAUDI_SOFTWARE:
        pytest.skip("the stand-in does not load beside a real Gaudi stack")
    path = tmp_path_factory.mktemp("selftest") / "report.json"
    proc = subprocess.run(
        [console_script("vllm-gaudi"), "selftest", "--json", str(path)],
        env=clean_env(BACKENDS[request.param]),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    report = json.loads(path.read_text()) if path.exists() else None
    return request.param, proc, report


def test_the_selftest_passes_and_its_report_is_complete(run):
    backend, proc, report = run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert report is not None and report["ok"]
    assert {c["kernel"] for c in report["kernels"]} == set(selftest_kernels.kernel_names())
    assert [r["function"] for r in report["runtime"]] == selftest.runtime_names()
    assert [p["id"] for p in report["probes"]] == [p.id for p in selftest_probes.PROBES]
    assert report["backend"]["answers_from"]["kind"] == backend
    if backend == "emulation":
        assert "checking the HPU platform in CPU emulation" in proc.stdout
    assert "result    OK" in proc.stdout


def test_the_engine_generates_and_its_perplexity_matches_the_host(run):
    backend, _, report = run
    engine = report["engine"]
    assert engine["ok"], engine
    assert engine["dtype"] == ("float32" if backend == "emulation" else "bfloat16")
    assert abs(engine["ratio"] - 1) <= engine["tolerance"]
    assert engine["recompiles_after_warmup"] == 0
    assert all(text for _, text in engine["completions"])
