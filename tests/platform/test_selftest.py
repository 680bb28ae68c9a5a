"""`vllm-gaudi selftest` in this process, on both backends (the emulation, and seam/gaudi over the
stand-in), without its engine part (tests/integration/test_selftest.py runs that): the report
covers every kernel of the `HpuBackend` Protocol and every probe, a kernel broken on purpose makes
it exit non-zero naming the kernel, and a report's decided default reaches the platform and
`doctor` unless an explicit setting wins.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from vllm_gaudi_platform import cli, config_checks, envs, selftest_defaults
from vllm_gaudi_platform.commands import doctor, selftest, selftest_kernels, selftest_probes
from vllm_gaudi_platform.worker.routed_experts import GATHER_COST_AS_STORED, gather_max_tokens

GATHER = envs.VLLM_MOE_GATHER_MAX_TOKENS
REPORT = envs.VLLM_HPU_SELFTEST_REPORT


def _run(capsys, tmp_path, *args: str) -> tuple[int, str, dict]:
    path = tmp_path / "selftest.json"
    status = cli.main(["selftest", "--no-engine", "--json", str(path), *args])
    # The screen with its wrapping undone, for matching phrases.
    screen = " ".join(capsys.readouterr().out.split())
    return status, screen, json.loads(path.read_text())


# doctor (asked where the default came from) probes NIXL in an interpreter of its own.
@pytest.mark.process
def test_the_report_covers_every_kernel_runtime_function_and_probe(hpu_backend, capsys, tmp_path):
    status, screen, report = _run(capsys, tmp_path)

    assert status == 0, screen
    assert report["ok"] and report["failed_kernels"] == []
    # The kernels come from the Protocol: its functions that take a tensor or a dtype.
    kernels = selftest_kernels.kernel_names()
    assert {"fused_sdpa", "mixture_of_experts", "fp8_gemm_v2", "mla_paged_decode"} <= set(kernels)
    assert sorted({c["kernel"] for c in report["kernels"]}) == sorted(kernels)
    for case in report["kernels"]:
        assert case["ok"], case
        assert case["generation"] == "Gaudi 3" and case["dtype"] and case["shape"]
    assert [r["function"] for r in report["runtime"]] == selftest.runtime_names()
    assert {"mem_get_info", "synchronize"} <= set(selftest.runtime_names())
    assert [p["id"] for p in report["probes"]] == [p.id for p in selftest_probes.PROBES]
    for probe in report["probes"]:
        assert probe["answer"] != "error", probe
        assert probe["verdict"] in ("confirms", "contradicts", "informs"), probe
    if hpu_backend.IS_EMULATED:
        # Not the emulation against itself: the independent float64 reference, and it says so.
        assert report["reference"] == "float64 reference"
        assert "not checked against itself" in screen
        expected_source = "emulation"
    else:
        assert report["reference"] == "emulated on cpu"
        expected_source = "stand-in"
    assert {p["source"] for p in report["probes"]} == {expected_source}
    assert report["backend"]["answers_from"]["kind"] == expected_source
    assert "not from hardware" in screen
    moe = report["timings"]["moe_batch1"]
    assert moe["dense_over_routed"] > 0 and moe["gathered_over_dense"] > 0
    assert len(report["timings"]["sdpa_buckets"]["buckets"]) == 3
    assert report["memory"]["allocation_bytes"] == 64 << 20
    assert report["memory"]["total_bytes"] >= report["memory"]["free_bytes"] > 0
    assert report["engine"] == {"skipped": "--no-engine"}

    # The probe's decision reaches the platform through the report file, and doctor says so.
    decided = report["decided_defaults"][GATHER]
    skips = next(p for p in report["probes"] if p["id"] == "moe_skips_empty_experts")
    assert decided["value"] == ("0" if skips["answer"] == "yes" else None)
    _check_report_default(tmp_path / "selftest.json", decided["value"])


def _check_report_default(path, value):
    mp = pytest.MonkeyPatch()
    try:
        mp.delenv(GATHER, raising=False)
        mp.setenv(REPORT, str(path))
        tokens, source = selftest_defaults.moe_gather_max_tokens()
        assert tokens == (None if value is None else int(value))
        entry = _doctor_entry()
        if value is None:
            assert (entry["origin"], tokens, source) == ("built-in default", None, "automatic")
            assert "confirmed by" in entry["detail"] and str(path) in entry["detail"]
        else:
            assert entry["origin"] == "selftest report" and str(path) in source
            assert "moe_skips_empty_experts" in entry["detail"]
        # The MoE layers take it (32 local experts, top-2, weights read as stored).
        automatic = math.ceil(32 / (2 * GATHER_COST_AS_STORED)) - 1
        expected = automatic if value is None else int(value)
        assert gather_max_tokens(32, 2, GATHER_COST_AS_STORED) == expected
        mp.setenv(GATHER, "5")  # an explicit setting wins over the report
        assert gather_max_tokens(32, 2, GATHER_COST_AS_STORED) == 5
        assert selftest_defaults.moe_gather_max_tokens() == (5, GATHER)
        assert _doctor_entry()["origin"] == "environment"
    finally:
        mp.undo()


def _doctor_entry() -> dict:
    report = doctor.collect()
    assert not [p for p in report.problems if REPORT in p], report.problems
    (entry,) = [d for d in report.defaults if d["name"] == GATHER]
    text = doctor.render(report)
    assert f"{GATHER}=" in text and entry["origin"] in text
    return entry


@pytest.mark.parametrize("kernel", ["rms_norm", "mixture_of_experts"])
def test_a_kernel_broken_on_purpose_fails_the_run_naming_it(
    hpu_backend, monkeypatch, capsys, tmp_path, kernel
):
    right = getattr(hpu_backend, kernel)

    def off_by_a_tenth(*args, **kwargs):
        return right(*args, **kwargs) + 0.1

    monkeypatch.setattr(hpu_backend, kernel, off_by_a_tenth)

    status, screen, report = _run(capsys, tmp_path)

    assert status == 1
    assert report["failed_kernels"] == [kernel] and not report["ok"]
    assert f"DISAGREES {kernel}" in screen
    assert f"disagreeing with their reference: {kernel}" in screen


def test_a_kernel_without_a_case_is_reported_uncovered(emulated, monkeypatch):
    monkeypatch.setattr(
        selftest_kernels, "kernel_names", lambda: ["rms_norm", "a_new_kernel_without_a_case"]
    )
    monkeypatch.setattr(
        selftest_kernels, "cases", lambda: [c for c in _cases() if c.kernel == "rms_norm"]
    )
    results = selftest_kernels.run_cases(emulated, _reference(), "3")
    missing = [r for r in results if r["kernel"] == "a_new_kernel_without_a_case"]
    assert missing == [
        {"kernel": "a_new_kernel_without_a_case", "ok": False, "error": "no selftest case for "
         "this kernel"}
    ]  # fmt: skip


_ORIGINAL_CASES = selftest_kernels.cases


def _cases():
    return _ORIGINAL_CASES()


def _reference():
    from vllm_gaudi_platform.commands.selftest_reference import Reference

    return Reference("3")


@pytest.mark.process
@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "no such file"),
        ("not json", "not a readable JSON report"),
        ('{"format": "something else"}', "not a vllm-gaudi selftest report"),
        ('{"format": "vllm-gaudi-selftest", "version": 99}', "version 99"),
        (
            '{"format": "vllm-gaudi-selftest", "version": 1, "decided_defaults": '
            '{"VLLM_MOE_GATHER_MAX_TOKENS": {"value": "many", "probe": "p"}}}',
            "not a whole number",
        ),
    ],
)
def test_a_bad_report_file_is_an_error_naming_the_setting_and_the_fix(
    monkeypatch, tmp_path, content, match
):
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(REPORT, str(path))
    monkeypatch.delenv(GATHER, raising=False)
    with pytest.raises(envs.EnvError, match=match) as error:
        selftest_defaults.moe_gather_max_tokens()
    assert REPORT in str(error.value) and "vllm-gaudi selftest --json" in str(error.value)
    report = doctor.collect()
    assert [p for p in report.problems if REPORT in p and match in p]
    # And an engine does not start with it, whatever its model (checked before workers spawn).
    limits = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=512),
        model_config=SimpleNamespace(max_model_len=512),
        cache_config=SimpleNamespace(block_size=128),
    )
    with pytest.raises(envs.EnvError, match=REPORT):
        config_checks.check_bucketing(limits)


def test_the_float64_reference_is_not_the_emulation(emulated):
    # A wrong emulated result against the reference fails: the reference computes on its own.
    case = next(c for c in selftest_kernels.cases() if c.kernel == "linear")
    reference = case.run(_reference(), selftest_kernels.to_device(torch.device("cpu")))
    assert reference.dtype == torch.float64
    got = case.run(emulated, selftest_kernels.to_device(torch.device("cpu")))
    assert torch.allclose(got.double(), reference, atol=1e-4)
