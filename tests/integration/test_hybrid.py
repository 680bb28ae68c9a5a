"""Mamba2 hybrids end to end: a tiny Granite 4.0-H-shaped model (GraniteMoeHybrid: Mamba2 layers
around an attention layer, MoE feed-forward blocks, no rotary embedding), a tiny Nemotron-H
(Mamba2 with two groups of B/C projections, attention and squared-ReLU MLP blocks as separate
layers) and a tiny Falcon-H1 (attention and a Mamba2 mixer side by side in every layer, muP
multipliers) generate on the HPU platform what transformers generates, through the `hpu_ops_mamba`
family's mixer.

The shared architectures run (architectures.py) serves 10 prompts of 1 to 300 tokens with at
most 4 prompts per step, one prefill row each, and at most 128 new tokens per prompt and step, so
the longer prompts continue from the state their earlier chunks left in their slot. Two more
engines keep the test engine's token budget (256) and 16 sequences, more prompts per step than
the 4 prompt rows: with the default buckets, such a step runs as several forward passes of rows
that warmed buckets hold (no recompile); with a bucket file of one 128-token prompt bucket, no
bucket holds some prompts even alone, and the step's prompts share a row at its exact shape,
which the mixer scans request by request (correct, and counted as recompiles). vLLM's own mixer
cannot run on this platform (Triton kernels), so equal tokens mean the HPU mixer ran.

Gated delta net hybrids (Qwen3-Next, Qwen3.5) and the refusal of state layers without HPU
kernels are test_gdn.py's.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.architectures import CASES, SEQUENTIAL_JOB, hpu_run, prompts
from tests.integration.generation import ENGINE, assert_close, hf_greedy, named_job_outputs, run_job

pytestmark = pytest.mark.engine

NAME = "granitemoehybrid"
NAMES = ("granitemoehybrid", "nemotron-h", "falcon-h1")
# Where each config lists its layers (transformers writes Mamba layers as "linear_attention");
# Falcon-H1 lists none: every layer has both.
LAYER_KEYS = {"granitemoehybrid": "layer_types", "nemotron-h": "layers_block_type"}
_REFERENCES: dict[str, list[dict]] = {}


def reference_of(name: str) -> list[dict]:
    if name not in _REFERENCES:
        _REFERENCES[name] = hf_greedy(str(CASES[name].build()), prompts(name))
    return _REFERENCES[name]


@pytest.fixture(scope="module", params=NAMES)
def hybrid(request) -> tuple[str, dict]:
    proc, result = hpu_run(request.param)
    assert result is not None, proc.stderr[-4000:]
    return request.param, result


# An operator's bucket file (exact warmup list) with one prompt bucket: a prompt with more than
# 128 new tokens, or continuing from context, fits no bucket even alone.
NARROW_BUCKETS = "(1, 128, 0)\n([1, 2, 4, 8, 16], 1, [4, 8, 16, 32, 64])\n"


@pytest.fixture(scope="module")
def many_per_step(tmp_path_factory) -> dict[str, dict]:
    """The test engine's budget and sequences (more prompts per step than prompt rows), with the
    default buckets ("passes") and with NARROW_BUCKETS ("packed")."""
    narrow = tmp_path_factory.mktemp("buckets") / "narrow.txt"
    narrow.write_text(NARROW_BUCKETS)
    job = {
        "model": str(CASES[NAME].build()),
        "prompts": prompts(NAME),
        "max_tokens": 12,
        "engine": ENGINE,
        "rounds": 1,
        "stats": True,
    }
    jobs = {"passes": job, "packed": {**job, "env": {"VLLM_BUCKETING_FROM_FILE": str(narrow)}}}
    proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), emulate=True, timeout=1200)
    results = named_job_outputs(proc)
    for name in jobs:
        result = results.get(name)
        assert result is not None and "error" not in result, proc.stderr[-4000:]
    return results


def test_hybrid_runs_on_the_hpu_platform_with_prompts_chunked_across_steps(hybrid):
    name, result = hybrid
    config = json.loads((CASES[name].build() / "config.json").read_text())
    if name in LAYER_KEYS:
        layers = config[LAYER_KEYS[name]]
        assert "linear_attention" in layers and "full_attention" in layers
    else:
        assert config["mamba_n_heads"] > 0 and config["num_attention_heads"] > 0
    assert result["platform"] == "HpuPlatform"
    chunk = CASES[name].hpu_engine["long_prefill_token_threshold"]
    assert sum(len(p) > chunk for p in prompts(name)) >= 3


def test_greedy_tokens_match_transformers(hybrid):
    name, result = hybrid
    diverged = assert_close(result["rounds"][0], reference_of(name), f"{name} on HPU")
    assert diverged == 0, f"{diverged} of 10 prompts diverge from transformers (float32)"


def test_no_recompiles_after_warmup_and_every_step_replays_a_graph(hybrid):
    stats = hybrid[1]["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    # Prompts never share a row: no packed variant is warmed or captured.
    assert stats["num_packed_graphs"] == 0
    assert stats["graph_replays"] > 0
    assert stats["eager_steps"] == 0, stats["eager_buckets"]


def test_more_prompts_than_rows_run_in_passes_of_warmed_rows_without_recompiles(many_per_step):
    result = many_per_step["passes"]
    diverged = assert_close(result["rounds"][0], reference_of(NAME), f"{NAME}, in passes")
    assert diverged == 0
    stats = result["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["split_steps"] > 0 and stats["packed_prefills"] == 0
    assert stats["eager_steps"] == 0, stats["eager_buckets"]


def test_prompts_sharing_a_row_are_scanned_one_by_one_and_counted_as_recompiles(many_per_step):
    packed = many_per_step["packed"]
    diverged = assert_close(packed["rounds"][0], reference_of(NAME), f"{NAME}, packed rows")
    assert diverged == 0
    assert packed["stats"]["packed_prefills"] > 0
    unwarmed = packed["stats"]["unwarmed_buckets"]
    assert unwarmed and all(b["phase"] == "prompt" for b in unwarmed), unwarmed
    assert packed["stats"]["recompiles"] == len(unwarmed)
