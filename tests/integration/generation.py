"""Helpers for end-to-end generation tests: run engines in fresh processes, run Hugging Face
transformers as the reference, and compare greedy outputs with vLLM's top-5 logprob rule."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

JOB = Path(__file__).with_name("engine_job.py")

ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "kv_cache_memory_bytes": 64 << 20,
    "seed": 0,
}


# The engine of the jobs that run make_prompts()[:6] and compile (compile_job.py) or capture every
# warmup bucket (the stand-in engine): six prompts of at most 200 tokens (206 with the tokens they
# generate) fit in 256 tokens and 8 sequences, and every bucket past those would be compiled in
# warmup for nothing (13 warmup graphs instead of 21).
COMPILE_ENGINE = {**ENGINE, "max_model_len": 256, "max_num_seqs": 8}


def make_prompts(seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Prompts of varied lengths (3..300 tokens) with shared prefixes, more than one bucket."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731 - 0-2 are special
    shared = tok(140)  # longer than one 128-token block: prefix caching can reuse it
    return [
        tok(3),
        tok(17),
        shared + tok(5),
        shared + tok(60),
        tok(129),
        tok(200),
        tok(300),
        shared[:64] + tok(9),
        tok(1),
        tok(90),
    ]


def run_job(
    script: Path,
    arg: str,
    env: dict[str, str | None] | None = None,
    *,
    emulate: bool = True,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`python script arg` in a fresh process that inherits no VLLM_* variable from this one: the
    HPU platform in emulation (`emulate`) or vLLM's own CPU backend with no plugin, plus `env`.

    The job is forked from a preloaded interpreter (tests/zygote.py) where its environment
    allows, else started fresh. The engine core runs inside the job's process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless `env`
    says otherwise: a spawned engine-core process imports torch and vLLM a second time, 20-50 s
    per job on a loaded 2-core machine, and every engine of a multi-engine job pays it again.
    The served tests (openai_server, tests/connectors) keep vLLM's engine-core process."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    run_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if emulate:
        run_env["VLLM_HPU_EMULATION"] = "cpu"
    else:
        run_env["VLLM_PLUGINS"] = ""
    for name, value in (env or {}).items():  # a value of None removes the variable
        if value is None:
            run_env.pop(name, None)
        else:
            run_env[name] = value
    from tests import zygote

    argv = [sys.executable, str(script), arg]
    proc = zygote.run(argv, run_env, timeout)
    if proc is not None:
        return proc
    return subprocess.run(argv, capture_output=True, text=True, env=run_env, timeout=timeout)


def job_output(proc: subprocess.CompletedProcess[str]) -> Any:
    """The JSON a job printed on its first `RESULT ` line, or None if it printed none."""
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return None


def named_job_outputs(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """What a job that runs several cases printed, one `RESULT <name> <json>` line per case."""
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            name, _, payload = line[len("RESULT ") :].partition(" ")
            results[name] = json.loads(payload)
    return results


def job_result(proc: subprocess.CompletedProcess[str], what: str) -> Any:
    """`job_output(proc)`; fails the test with the ends of the job's output if it printed none."""
    result = job_output(proc)
    if result is None:
        import pytest

        pytest.fail(f"{what} printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return result


def run_engine(
    model: str,
    prompts: list[list[int]],
    *,
    emulate: bool,
    max_tokens: int = 12,
    rounds: int = 1,
    env: dict[str, str] | None = None,
    engine: dict | None = None,
    timeout: int = 600,
    extra: dict | None = None,
) -> tuple[subprocess.CompletedProcess, dict | None]:
    job = {
        "model": model,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "engine": {**ENGINE, **(engine or {})},
        "rounds": rounds,
        "stats": emulate,
        **(extra or {}),  # further engine_job.py keys
    }
    proc = run_job(JOB, json.dumps(job), env, emulate=emulate, timeout=timeout)
    return proc, job_output(proc)


def greedy_generate(hf: Any, max_tokens: int, **inputs: Any) -> dict:
    """transformers' greedy continuation of one prompt (`inputs`: input_ids and whatever else
    the model takes), never stopping at EOS: the tokens and each step's top-5 logprobs."""
    import torch

    out = hf.generate(
        **inputs,
        max_new_tokens=max_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = []
    for score in out.scores:
        top = torch.topk(torch.log_softmax(score[0].float(), dim=-1), 5)
        logprobs.append({str(i): v for i, v in zip(top.indices.tolist(), top.values.tolist())})
    return {"tokens": tokens, "logprobs": logprobs}


def hf_greedy(
    model: str,
    prompts: list[list[int]],
    max_tokens: int = 12,
    dtype: str = "float32",
    attn_implementation: str | None = None,
) -> list[dict]:
    """Greedy continuation with transformers, one prompt at a time (no padding effects).
    `attn_implementation="eager"` for models whose attention transformers' SDPA path does not
    implement (Gemma 2's logit soft-capping)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
    ).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos=True on the vLLM side
    results = []
    with torch.no_grad():
        for prompt in prompts:
            results.append(greedy_generate(hf, max_tokens, input_ids=torch.tensor([prompt])))
    return results


# How many prompts in 10 a quantized engine may take off the reference's greedy path (each
# divergence within vLLM's top-5 rule). Weight-only 4-bit reproduces its dequantized weights
# exactly in float32, so only near-ties may flip (measured: 0 of 10 for every 4-bit format).
# FP8 has no such bound on the random tiny models: rounding every activation flips their
# near-tied logits, and 6 to 10 of 10 prompts diverge (measured for FP8 W8A8 linears, FP8 MoE,
# INC and an FP8 KV cache); its accuracy is measured on the trained model instead
# (test_trained_model.py: held-out perplexity over float).
DIVERGED_PER_10 = {"4-bit": 1}


def assert_few_diverged(diverged: int, prompts: int, kind: str, label: str) -> None:
    """At most DIVERGED_PER_10[kind] of every 10 prompts diverged (`assert_close`'s count)."""
    allowed = DIVERGED_PER_10[kind] * prompts // 10
    assert diverged <= allowed, (
        f"{label}: {diverged} of {prompts} prompts left the reference's greedy path "
        f"({kind}: at most {allowed})"
    )


def assert_close(ours: list[dict], ref: list[dict], label: str) -> int:
    """vLLM's check_logprobs_close rule: identical greedy tokens, or at the first divergence each
    side's token is in the other's top-5. Returns how many sequences diverged (near-ties)."""
    diverged = 0
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        for pos, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
            if ta == tb:
                continue
            assert str(ta) in b["logprobs"][pos] and str(tb) in a["logprobs"][pos], (
                f"{label}: prompt {i} diverges at token {pos}: ours {ta} "
                f"(top5 {a['logprobs'][pos]}) vs reference {tb} (top5 {b['logprobs'][pos]})"
            )
            diverged += 1
            break
        else:
            assert len(a["tokens"]) == len(b["tokens"]), f"{label}: prompt {i} length differs"
    return diverged
