"""Sliding-window attention and logit soft-capping end to end: tiny Gemma 2 (windowed layers
alternating with global ones, attention and final soft-capping), Gemma 3 (two local layers, then a
global one with its own rotary base; q/k norms, no soft-capping), Mistral and Qwen2 with
use_sliding_window (every layer windowed; Qwen2 with q/k/v biases) generate on the HPU platform
what transformers generates, with windows shorter than most prompts (so the window really cuts),
prompts longer than one 128-token block, each layer windowed as transformers windows it, and no
recompile after warmup."""

from __future__ import annotations

import json
import re

import pytest

from gaudi_testkit import tinymodels
from tests.integration import architectures
from tests.integration.generation import assert_close, hf_greedy, make_prompts

pytestmark = pytest.mark.engine

# name -> transformers attention implementation for the reference (its SDPA path ignores
# Gemma 2's soft-capping; eager implements it).
MODELS = {"gemma2": "eager", "gemma3": None, "mistral": None, "qwen2": None}
WINDOWS = {"gemma2": 64, "gemma3": 32, "mistral": 48, "qwen2": 40}


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request) -> tuple[str, dict, list[dict]]:
    name = request.param
    model = str(tinymodels.build(name))
    prompts = make_prompts()
    # Shared with test_cpu_backend.py: one HPU engine per model and session.
    assert architectures.prompts(name) == prompts
    proc, result = architectures.hpu_run(name)
    assert result is not None, proc.stderr[-4000:]
    reference = hf_greedy(model, prompts, attn_implementation=MODELS[name])
    return name, result, reference


def test_windowed_model_runs_and_the_window_is_shorter_than_the_prompts(case):
    name, result, _ = case
    config = json.loads((tinymodels.build(name) / "config.json").read_text())
    assert config["sliding_window"] == WINDOWS[name]
    assert result["platform"] == "HpuPlatform"
    assert max(len(p) for p in make_prompts()) > 2 * WINDOWS[name]


def test_each_layer_is_windowed_as_transformers_windows_it(case):
    # The reference's layout (layer_types; Mistral's config has none and windows every layer)
    # against the window each attention layer of the HPU engine was built with. For Qwen2 this
    # is where the two could part: transformers windows the layers i >= max_window_layers,
    # vLLM's Qwen2 every layer.
    from transformers import AutoConfig

    name, result, _ = case
    config = AutoConfig.from_pretrained(tinymodels.build(name))
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * layers
    expected = [WINDOWS[name] if t == "sliding_attention" else None for t in types]
    engine = {
        int(re.search(r"layers\.(\d+)\.", layer)[1]): window
        for layer, window in result["layer_windows"].items()
    }
    assert [engine[i] for i in range(layers)] == expected, engine


def test_tiny_gemma2_soft_caps_attention_and_final_logits():
    # The config as transformers (the reference) and vLLM's Gemma 2 read it: soft-capping on.
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tinymodels.build("gemma2"))
    assert config.attn_logit_softcapping is not None and config.attn_logit_softcapping > 0
    assert config.final_logit_softcapping is not None and config.final_logit_softcapping > 0


def _gemma2_greedy(prompts, *, window: bool = True, soft_cap: bool = True) -> list[list[int]]:
    """Transformers' greedy tokens of the tiny Gemma 2, optionally without its window or its
    attention soft-cap."""
    import torch
    from transformers import AutoModelForCausalLM

    extra = {} if window else {"sliding_window": 4096}
    hf = AutoModelForCausalLM.from_pretrained(
        tinymodels.build("gemma2"), attn_implementation="eager", **extra
    ).eval()
    if not soft_cap:
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def test_tiny_gemma2_greedy_tokens_depend_on_its_window_and_its_soft_cap():
    # Without this, the window and soft-cap checks above could pass on a model whose attention
    # decides nothing (tinymodels.BLOCK_OUTPUT_GAIN says why the recipe needed a gain).
    prompts = make_prompts()
    base = _gemma2_greedy(prompts)
    no_window = _gemma2_greedy(prompts, window=False)
    no_cap = _gemma2_greedy(prompts, soft_cap=False)
    changed_by_window = sum(a != b for a, b in zip(base, no_window))
    changed_by_cap = sum(a != b for a, b in zip(base, no_cap))
    print(f"gemma2: the window decides {changed_by_window}, the soft-cap {changed_by_cap} of 10")
    assert changed_by_window >= 3 and changed_by_cap >= 3


def test_greedy_tokens_match_transformers(case):
    name, result, reference = case
    diverged = assert_close(result["rounds"][0], reference, f"{name} on HPU vs transformers")
    print(f"{name}: {diverged} of 10 prompts diverge from transformers (top-5)")
    assert diverged <= 2, f"{diverged} of 10 prompts hit near-ties; expected at most 2"


def test_no_recompiles_after_warmup(case):
    name, result, _ = case
    # Every serving pass replays a warmed graph: with windowed layers a packed prefill row takes
    # another attention branch than one sequence per row, and warmup captures that variant too.
    stats = result["stats"]
    print(name, {k: stats[k] for k in ("eager_steps", "variant_misses", "eager_buckets")})
    assert result["stats"]["recompiles"] == 0, result["stats"]["unwarmed_buckets"]
    assert stats["num_packed_graphs"] > 0
    assert stats["eager_steps"] == 0, (stats["variant_misses"], stats["eager_buckets"])
