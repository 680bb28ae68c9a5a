"""Model-level proof for the ops wheel: tiny models that exercise each op family generate, on the
HPU platform in emulation, what transformers generates on the same weights; per-family counters
show which families' Gaudi paths ran; trimming families with VLLM_PLUGINS changes which code runs
but not the tokens."""

from __future__ import annotations

import json

import pytest

from gaudi_testkit import tinymodels
from tests.integration.generation import assert_close, hf_greedy, make_prompts, run_engine

pytestmark = pytest.mark.engine

PROMPTS = make_prompts(seed=1)[:6]
STATS_ENV = "VLLM_HPU_OPS_STATS_FILE"


def _generate(name: str, tmp_path, plugins: str | None = None):
    model = str(tinymodels.build(name))
    stats_file = tmp_path / f"ops-{name}-{plugins or 'all'}.json"
    env = {STATS_ENV: str(stats_file)}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    proc, result = run_engine(model, PROMPTS, emulate=True, max_tokens=10, env=env)
    assert result is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    return model, result["rounds"][0], counts


@pytest.fixture(scope="module")
def llama_all(tmp_path_factory):
    return _generate("llama", tmp_path_factory.mktemp("llama"))


# model name -> op families its layers must have dispatched to
FAMILIES = {
    "gemma": {"norm", "rotary", "activation"},
    "mixtral": {"norm", "rotary", "moe"},
    "llama-rope-scaling": {"norm", "rotary", "activation"},
}


def test_llama_matches_transformers_with_every_family_dispatched(llama_all):
    model, tokens, counts = llama_all
    assert {"norm", "rotary", "activation"} <= {f for f, n in counts.items() if n > 0}, counts
    assert_close(tokens, hf_greedy(model, PROMPTS, max_tokens=10), "llama (all op families)")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_model_matches_transformers_through_its_op_families(name, tmp_path):
    model, tokens, counts = _generate(name, tmp_path)
    ran = {f for f, n in counts.items() if n > 0}
    assert FAMILIES[name] <= ran, counts
    assert_close(tokens, hf_greedy(model, PROMPTS, max_tokens=10), name)


def test_trimming_to_the_norm_family_runs_only_norm_and_keeps_the_tokens(llama_all, tmp_path):
    _, all_tokens, _ = llama_all
    _, tokens, counts = _generate("llama", tmp_path, plugins="hpu,hpu_ops_norm")
    assert {f for f, n in counts.items() if n > 0} == {"norm"}, counts
    assert [t["tokens"] for t in tokens] == [t["tokens"] for t in all_tokens]
