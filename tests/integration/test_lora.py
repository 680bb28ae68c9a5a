"""Multi-LoRA on the HPU platform (CPU emulation), one engine process for every check
(lora_job.py): two PEFT adapters of different ranks and the base model in the same batches give
the greedy tokens of transformers on the merged weights (base + lora_alpha / r * B @ A), within the
top-5 rule; adapters are unloaded and loaded back at run time; no shape runs after warmup that
warmup did not run (buckets and LoRA kernel shapes). Then the same through `vllm serve` on the
Gaudi backend over the Habana stand-in, its tensors on the stand-in's "hpu" device (--enable-lora,
--lora-modules, an adapter loaded and later unloaded over HTTP at run time), with n-gram
speculative decoding on the same server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gaudi_testkit import tinymodels
from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration import lora_adapters, openai_server
from tests.integration.generation import (
    ENGINE,
    assert_close,
    hf_greedy,
    make_prompts,
    named_job_outputs,
    run_job,
)

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("lora_job.py")
MAX_TOKENS = 8
# name -> (seed, rank, lora_alpha): different ranks, both below max_lora_rank's padding
ADAPTERS = {"alpha": (1, 8, 16), "beta": (2, 4, 4)}
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 2,
}
# Served speculation that gets accepted: prompts of REPEATS tokens that repeat one token (see
# repeating_prompts), SPEC_MAX_TOKENS greedy tokens each.
REPEATS = 16
SPEC_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """The base model and, per adapter, the adapter and its merged model."""
    base = tinymodels.build("llama")
    root = tinymodels.cache_root() / "lora"
    out = {"base": base}
    for name, (seed, rank, alpha) in ADAPTERS.items():
        adapter = lora_adapters.build_adapter(
            base,
            root / f"{base.name}-{name}-{seed}-{rank}-{alpha}",
            seed=seed,
            rank=rank,
            alpha=alpha,
        )
        out[name] = adapter
        out[f"{name}-merged"] = lora_adapters.merge(base, adapter, root / f"{adapter.name}-merged")
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()[:6]


@pytest.fixture(scope="module")
def run(models, prompts) -> dict:
    job = {
        "model": str(models["base"]),
        "adapters": {name: str(models[name]) for name in ADAPTERS},
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "engine": {**ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
    }
    proc = run_job(JOB, json.dumps(job))
    results = named_job_outputs(proc)
    if set(results) != {"mixed", "runtime", "stats"}:
        pytest.fail(
            f"LoRA job incomplete ({sorted(results)}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return results


@pytest.fixture(scope="module")
def reference(models, prompts) -> dict[str, list[dict]]:
    refs = {"base": hf_greedy(str(models["base"]), prompts, MAX_TOKENS)}
    for name in ADAPTERS:
        refs[name] = hf_greedy(str(models[f"{name}-merged"]), prompts, MAX_TOKENS)
    return refs


@pytest.mark.parametrize("name", ["base", *ADAPTERS])
def test_mixed_batch_matches_transformers_on_merged_weights(run, reference, name):
    assert_close(run["mixed"][name], reference[name], f"LoRA {name}")


def test_adapters_change_the_output(run):
    base = [r["tokens"] for r in run["mixed"]["base"]]
    for name in ADAPTERS:
        assert [r["tokens"] for r in run["mixed"][name]] != base, f"{name} had no effect"


def test_remove_lora_unloads_the_adapter(run):
    runtime = run["runtime"]
    assert runtime["loaded"] == [1, 2]
    assert runtime["removed"] is True and runtime["after_remove"] == [2]


def test_removed_adapter_reloads_at_run_time_with_the_same_output(run):
    runtime = run["runtime"]
    assert runtime["after_reload"] == [1, 2]
    first, second = runtime["reloaded_outputs"]
    assert first["tokens"] == run["mixed"]["alpha"][0]["tokens"]
    assert second["tokens"] == run["mixed"]["beta"][0]["tokens"]


def test_add_lora_loads_an_adapter_explicitly(run):
    assert run["runtime"]["added"] is True and run["runtime"]["after_add"] == [1, 2]


def test_no_recompiles_after_warmup_with_lora(run):
    stats = run["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["lora_unwarmed_shapes"] == []
    # Steps that mixed prefills and decodes ran as two passes on warmed buckets, each with its
    # own tokens' adapter slots (the tokens above equal the merged-weight reference).
    assert stats["split_steps"] > 0


# --- the same adapters through `vllm serve` -------------------------------------------------------
# One server, on the Gaudi backend over the Habana stand-in (device tensors, mixed ops refused):
# --enable-lora with adapter "alpha" named by --lora-modules at start-up, "beta" loaded
# at run time through POST /v1/load_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING), and requests
# for alpha, beta and the base model sent at once, so the server batches them together; at the
# end beta is unloaded through POST /v1/unload_lora_adapter. The server also speculates (n-gram):
# greedy tokens must not change, and on prompts whose continuation repeats them vLLM counts drafts
# that were accepted.


@pytest.fixture(scope="module")
def lora_server(models, clean_env, tmp_path_factory) -> Iterator[httpx.Client]:
    args = openai_server.engine_args(str(models["base"]), ENGINE)
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    args += ["--lora-modules", f"alpha={models['alpha']}"]
    # n-gram speculation on the same server: verification steps carry the adapters too.
    args += ["--speculative-config", json.dumps(NGRAM)]
    env = openai_server.server_env(clean_env())
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if not REAL_GAUDI_SOFTWARE:
        # The served engine is a Gaudi's: seam/gaudi over the Habana stand-in, its tensors on the
        # stand-in's "hpu" device (the offline job above runs the emulation).
        for name, value in STANDIN_ENGINE_ENV.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
    log = tmp_path_factory.mktemp("serve-lora") / "server.log"
    with (
        openai_server.running(args, env, log) as base,
        httpx.Client(base_url=base, timeout=120, trust_env=False) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def served(lora_server, models, prompts) -> dict[str, list[dict]]:
    """Greedy completions per model name (alpha, beta, base), requested concurrently."""
    loaded = lora_server.post(
        "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": str(models["beta"])}
    )
    assert loaded.status_code == 200, loaded.text
    names = {"alpha": "alpha", "beta": "beta", "base": str(models["base"])}

    def complete(name: str) -> list[dict]:
        body = openai_server.completion_body(prompts, MAX_TOKENS, model=names[name])
        choices = openai_server.post(lora_server, "/v1/completions", body)["choices"]
        return [openai_server.as_result(c) for c in sorted(choices, key=lambda c: c["index"])]

    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(complete, names)))


def test_served_models_list_the_adapter_named_at_start_up(lora_server):
    response = lora_server.get("/v1/models")
    assert response.status_code == 200, response.text
    listed = {m["id"] for m in response.json()["data"]}
    assert "alpha" in listed


@pytest.mark.parametrize("name", ["base", *ADAPTERS])
def test_served_completions_per_adapter_match_transformers_on_merged_weights(
    served, reference, name
):
    assert_close(served[name], reference[name], f"served LoRA {name}")


@pytest.fixture(scope="module")
def repeating_prompts(models) -> list[list[int]]:
    """Prompts whose greedy continuation (base model) repeats their tokens, found with
    transformers rather than named here, so that they follow the tiny model's weights.

    The random-weight base model's continuations of random prompts never repeat, so the n-gram
    drafter has nothing to propose. A few tokens are fixed points instead ([t] * n -> t, t, ...):
    one prompt per such token, whose drafts are all accepted, and one with an odd token in the
    middle ([t] * 8 + [u] + [t] * 7) whose continuation repeats t at first and then breaks off
    in its first half, so that a draft of t is rejected."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(models["base"]), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as in hf_greedy: no row stops early
    tokens = torch.arange(3, hf.config.vocab_size)  # 0-2 are special
    with torch.no_grad():
        logits = hf(tokens[:, None].repeat(1, REPEATS)).logits[:, -1]
    fixed = tokens[logits.argmax(-1) == tokens].tolist()[:3]
    assert fixed, "the base model repeats no token: nothing for the n-gram drafter to find"
    half = REPEATS // 2
    for t in fixed:
        odd = [[t] * half + [u] + [t] * (REPEATS - half - 1) for u in tokens.tolist() if u != t]
        with torch.no_grad():
            out = hf.generate(torch.tensor(odd), max_new_tokens=SPEC_MAX_TOKENS, do_sample=False)
        early = out[:, REPEATS : REPEATS + SPEC_MAX_TOKENS // 2].tolist()
        broken = [p for p, o in zip(odd, early) if o[:2] == [t, t] and set(o) != {t}]
        if broken:
            return [[t] * REPEATS for t in fixed] + broken[:1]
    pytest.fail(f"no repetition of {fixed} that the base model breaks off")


@pytest.fixture(scope="module")
def repeating_reference(models, repeating_prompts) -> list[dict]:
    return hf_greedy(str(models["base"]), repeating_prompts, SPEC_MAX_TOKENS)


def spec_decode_counters(client: httpx.Client) -> dict[str, float]:
    """vLLM's spec-decode counters from /metrics, summed over labels (per-position counts too)."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    totals: dict[str, float] = {}
    for line in response.text.splitlines():
        if line.startswith("vllm:spec_decode_"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{")[0]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def test_served_model_speculates_and_vllm_counts_accepted_drafts(
    lora_server, models, repeating_prompts, repeating_reference
):
    # Counters are cumulative over the server's life: only this request's share is checked.
    before = spec_decode_counters(lora_server)
    body = openai_server.completion_body(
        repeating_prompts, SPEC_MAX_TOKENS, model=str(models["base"])
    )
    choices = openai_server.post(lora_server, "/v1/completions", body)["choices"]
    # vLLM answers before it records the last step's stats: read until two reads agree.
    after, again = None, spec_decode_counters(lora_server)
    while again != after:
        time.sleep(0.3)
        after, again = again, spec_decode_counters(lora_server)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}

    tokens = [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]
    assert tokens == [r["tokens"] for r in repeating_reference], "greedy tokens changed"
    drafts = delta["vllm:spec_decode_num_drafts_total"]
    drafted = delta["vllm:spec_decode_num_draft_tokens_total"]
    accepted = delta["vllm:spec_decode_num_accepted_tokens_total"]
    print(f"served n-gram speculation: {drafts:.0f} drafts, {accepted:.0f}/{drafted:.0f} accepted")
    assert drafts > 0
    # The broken-off repetition rejects a draft, so fewer are accepted than drafted.
    assert 0 < accepted < drafted
    assert delta["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == accepted


def test_served_lora_runs_no_shape_after_warmup_that_warmup_did_not(lora_server, served):
    stats = openai_server.post(lora_server, "/collective_rpc", {"method": "get_recompile_stats"})
    stats = stats["results"][0]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["lora_unwarmed_shapes"] == []


# Last in the module: it unloads beta from the shared server. vLLM 0.32's unload forgets the
# adapter's name in the API server only (the engine keeps its weights until its LRU cache evicts
# them), so a request naming it is refused before it reaches the engine.
def test_served_adapter_unloaded_at_run_time_is_gone_while_the_others_still_answer(
    lora_server, served, models, prompts, reference
):
    def listed() -> set[str]:
        response = lora_server.get("/v1/models")
        assert response.status_code == 200, response.text
        return {m["id"] for m in response.json()["data"]}

    assert "beta" in listed()
    unloaded = lora_server.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert unloaded.status_code == 200, unloaded.text
    assert listed() >= {"alpha", str(models["base"])} and "beta" not in listed()

    body = openai_server.completion_body(prompts[:1], MAX_TOKENS, model="beta")
    refused = lora_server.post("/v1/completions", json=body)
    assert refused.status_code == 404, refused.text
    error = refused.json()["error"]
    assert error["type"] == "NotFoundError" and "`beta` does not exist" in error["message"]

    for key, name in (("alpha", "alpha"), ("base", str(models["base"]))):
        body = openai_server.completion_body(prompts, MAX_TOKENS, model=name)
        choices = openai_server.post(lora_server, "/v1/completions", body)["choices"]
        results = [openai_server.as_result(c) for c in sorted(choices, key=lambda c: c["index"])]
        assert_close(results, reference[key], f"served LoRA {key} after unloading beta")
