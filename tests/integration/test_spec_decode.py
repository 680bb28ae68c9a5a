"""End to end: speculative decoding on the HPU platform (CPU emulation) with the n-gram drafter,
EAGLE and EAGLE-3 draft heads, and an MTP layer.

One job process runs the same greedy prompts without speculation and then with each drafter (see
spec_decode_job.py). The model is the locally trained tiny Llama: its greedy output repeats
phrases, so n-gram drafts get accepted (a random-weight model's output never repeats). The heads
are fitted to it in closed form (eagle_drafts.py), so some of their drafts are accepted too.
The MTP run serves the same weights as a MiMo checkpoint that carries one MTP layer, fitted the
same way (mtp_drafts.py); being the same target, its greedy tokens must equal the plain run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration import eagle_drafts, mtp_drafts
from tests.integration.generation import ENGINE, job_result, run_job
from vllm_gaudi_platform.commands import demo_model

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("spec_decode_job.py")
SAMPLING_JOB = Path(__file__).with_name("spec_sampling_job.py")
K = 3
MAX_TOKENS = 32
TEXTS = [
    "for x in range(10): print(x)\nfor x in range(10): print(x)\nfor x in range(10):",
    "The list is a list. The list is a list. The list is",
    "def f(a, b):\n    return a + b\n\ndef g(a, b):\n    return a + b\n\ndef h(a, b):",
    "import os\nimport sys\nimport os\nimport sys\nimport",
    'The "x" statement',
    "class A:\n    pass\n\nclass B:\n    pass\n\nclass",
]
RANDOM_PROMPTS = 2
HEADS = ("eagle", "eagle3")
DRAFTERS = ("ngram", *HEADS, "mtp")


def spec_job(drafters: tuple[str, ...]) -> dict:
    """The job: the plain run, then one run per drafter, on the same prompts."""
    from transformers import AutoTokenizer

    model = str(demo_model.build(progress=False))
    tokenizer = AutoTokenizer.from_pretrained(model)
    configs = {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 2,
        },
        **{
            method: {
                "method": method,
                "model": str(eagle_drafts.build(method)),
                "num_speculative_tokens": K,
            }
            for method in HEADS
            if method in drafters
        },
        "mtp": {"method": "mtp", "num_speculative_tokens": K},
    }
    return {
        "model": model,
        "prompts": [tokenizer(t)["input_ids"] for t in TEXTS],
        "max_tokens": MAX_TOKENS,
        "engine": ENGINE,
        "speculative_configs": {name: configs[name] for name in drafters},
        "targets": {"mtp": str(mtp_drafts.build())} if "mtp" in drafters else {},
        "random_prompts": RANDOM_PROMPTS,
    }


@pytest.fixture(scope="module")
def result() -> dict:
    return job_result(run_job(JOB, json.dumps(spec_job(DRAFTERS))), "speculative decoding job")


# EAGLE on the Gaudi backend: seam/gaudi over the Habana stand-in, the target's and the draft
# head's tensors on its torch device "hpu" (mixed host/device ops refused), HPU graphs in lazy
# mode. The n-gram drafter runs there in the served LoRA engine (test_lora.py).
@pytest.fixture(scope="module")
def on_gaudi() -> dict:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("the stand-in does not load beside a real Gaudi stack (the tests run there)")
    env = {**STANDIN_ENGINE_ENV, "PT_HPU_LAZY_MODE": "1"}
    job = json.dumps(spec_job(("eagle",)))
    return job_result(run_job(JOB, job, env), "speculative decoding job on seam/gaudi")


def test_eagle_on_gaudi_py_gives_the_emulations_tokens_and_accepts_drafts(on_gaudi, result):
    assert on_gaudi["runs"]["eagle"]["stats"]["seam"] == "gaudi"
    assert on_gaudi["runs"]["eagle"]["stats"]["kv_cache_devices"] == ["hpu"]
    assert on_gaudi["plain"] == result["plain"]
    assert on_gaudi["runs"]["eagle"]["spec"] == result["plain"]
    metrics = on_gaudi["runs"]["eagle"]["metrics"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert (
        metrics["vllm:spec_decode_num_accepted_tokens"]
        <= (metrics["vllm:spec_decode_num_draft_tokens"])
    )
    stats = on_gaudi["runs"]["eagle"]["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["bucket_hits"].get("verify", 0) > 0, stats["bucket_hits"]


def test_plain_run_generates_every_token(result):
    assert all(len(tokens) == MAX_TOKENS for tokens in result["plain"])


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_tokens_with_speculation_equal_those_without(result, drafter):
    assert result["runs"][drafter]["spec"] == result["plain"]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_drafts_are_proposed_and_accepted_and_vllm_counts_them(result, drafter):
    metrics = result["runs"][drafter]["metrics"]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]

    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert 0 < accepted <= drafted
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_position) == K and sum(per_position) == accepted


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_random_sampled_requests_verify_alongside_greedy_ones(result, drafter):
    sampled = result["runs"][drafter]["sampled"]
    assert len(sampled) == RANDOM_PROMPTS
    assert all(len(tokens) == MAX_TOKENS for tokens in sampled)
    vocab = demo_model_vocab_size()
    assert all(0 <= t < vocab for tokens in sampled for t in tokens)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_verification_and_drafting_steps_run_on_warmed_buckets(result, drafter):
    stats = result["runs"][drafter]["stats"]

    assert stats["num_verify_buckets"] > 0
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    # Verification steps land on the verify buckets warmup added for them (not only on prompt
    # buckets, which would leave those graphs unused). Measured: 15 (n-gram) to 62 (EAGLE-3).
    assert stats["bucket_hits"].get("verify", 0) > 0, stats["bucket_hits"]


def demo_model_vocab_size() -> int:
    config = json.loads((demo_model.build(progress=False) / "config.json").read_text())
    return int(config["vocab_size"])


# --- the rejection sampler's output distribution ------------------------------------------------
# One prompt sampled SAMPLES times at temperature 1 with EAGLE drafts (a head proposes at every
# step): the second token comes from a verification step and must follow the target model's own
# distribution whatever the head proposed. Chi-square at alpha = 0.001 over the tokens expected
# at least 5 times, for the samples whose first token was the most frequent one.
SAMPLES = 800
# Upper 0.001 quantiles of the chi-square distribution, by degrees of freedom.
CHI2_CRITICAL = dict(
    enumerate(
        (
            *(10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588),
            *(31.264, 32.909, 34.528, 36.123, 37.697, 39.252, 40.790, 42.312, 43.820, 45.315),
        ),
        start=1,
    )
)


@pytest.fixture(scope="module")
def sampling() -> dict:
    from transformers import AutoTokenizer

    model = str(demo_model.build(progress=False))
    prompt = AutoTokenizer.from_pretrained(model)(TEXTS[0])["input_ids"]
    job = {
        "model": model,
        "prompt": prompt,
        "samples": SAMPLES,
        "speculative_config": {
            "method": "eagle",
            "model": str(eagle_drafts.build("eagle")),
            "num_speculative_tokens": 2,
        },
        "engine": ENGINE,
    }
    return job_result(run_job(SAMPLING_JOB, json.dumps(job)), "speculative sampling job")


def _chi_square(observed: list[int], probs: dict[int, float]) -> tuple[float, int]:
    """Pearson's statistic of `observed` tokens against `probs` (token -> probability), binned
    as each token expected at least 5 times plus the rest; and its degrees of freedom."""
    n = len(observed)
    bins = [t for t, p in sorted(probs.items(), key=lambda kv: -kv[1]) if n * p >= 5]
    rest = max(1.0 - sum(probs[t] for t in bins), 0.0)
    expected = [n * probs[t] for t in bins] + [n * rest]
    counts = [sum(1 for x in observed if x == t) for t in bins]
    counts.append(n - sum(counts))
    stat = 0.0
    for c, e in zip(counts, expected, strict=True):
        stat += (c - e) ** 2 / e if e > 0 else (float("inf") if c else 0.0)
    return stat, len(bins)  # len(bins) + 1 cells, one constraint


def test_random_sampled_tokens_after_verification_follow_the_target_distribution(sampling):
    import math
    from collections import Counter

    pairs = sampling["pairs"]
    first, _ = Counter(p[0] for p in pairs).most_common(1)[0]
    observed = [p[1] for p in pairs if p[0] == first]
    assert len(observed) >= 200, Counter(p[0] for p in pairs).most_common(5)
    probs = {int(t): math.exp(lp) for t, lp in sampling["target"][str(first)].items()}
    stat, dof = _chi_square(observed, probs)
    assert 1 <= dof <= max(CHI2_CRITICAL)
    assert stat < CHI2_CRITICAL[dof], (stat, dof, Counter(observed).most_common(8), probs)

    # The test can tell a wrong sampler: one that always returned the same token (as accepting
    # every greedy draft would) is rejected.
    mode = Counter(observed).most_common(1)[0][0]
    wrong_stat, _ = _chi_square(observed, {mode: 1.0})
    assert wrong_stat > CHI2_CRITICAL[1]

    metrics = sampling["metrics"]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    # Drafts were verified, and some rejected: the residual distribution was sampled too.
    assert 0 < accepted < drafted
