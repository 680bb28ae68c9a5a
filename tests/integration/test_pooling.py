"""Pooling models (`runner="pooling"`: embeddings, classification) on the HPU platform in CPU
emulation.

Two tiny models: the random Llama as a decoder embedding model (vLLM's default for it: the last
token's hidden state, L2-normalised) and a tiny BERT, an encoder-only model whose attention is
bidirectional (`AttentionType.ENCODER_ONLY`, no KV cache), mean-pooled and L2-normalised. Both are
compared with transformers computing the same pooling on its own hidden states, offline
(`LLM(..., runner="pooling").embed`, both in the one job process of pooling_job.py) and each
through a server answering `/v1/embeddings` (one server at a time; each starts in about 30 s).
The offline job makes the models' `compute_logits` refuse to run: warmup and serving of a
pooling model must never call it.

A classification model (the tiny Llama with a 3-class score head,
LlamaForSequenceClassification) runs in the same job process after the embedding models; its class
probabilities must equal transformers' softmax of the same head. So does a reward model (a tiny
Qwen2ForRewardModel: a two-layer score head giving one reward per token), whose rewards must
equal that head applied in float64 to transformers' hidden states of the same checkpoint.

The prompts (1 to 300 tokens) are embedded together, so prompts of mixed lengths share bucketed
steps (packed rows, a one-token prompt in the decode part), and again one by one: both must equal
the reference, and no step may need a shape warmup did not run.

Engines run with the platform's defaults, HPU graphs on: the embeddings come from replayed
graphs wherever a step's bucket has one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gaudi_testkit import tinymodels
from tests.integration import openai_server
from tests.integration.compile_job import fitted_plan_env
from tests.integration.generation import make_prompts, named_job_outputs, run_job

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("pooling_job.py")
# float32 on both sides; the largest differences measured are below 5e-7 (unit-norm vectors)
# and 3e-6 (token rewards, which range from about -1.8 to 2.9).
TOLERANCE = 1e-4
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 64 << 20,
    "seed": 0,
}
BERT_POOLER = {"seq_pooling_type": "MEAN"}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        "llama": str(tinymodels.build("llama")),
        "bert": str(tinymodels.build("bert")),
        "classifier": str(classifier(tmp_path_factory.mktemp("classifier"))),
        "reward": str(reward_model(tmp_path_factory.mktemp("reward"))),
    }


def classifier(folder: Path) -> Path:
    """The tiny Llama with a seeded 3-class score head on its last token's hidden state
    (LlamaForSequenceClassification, which vLLM runs as a classification model)."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    source = tinymodels.build("llama")
    torch.manual_seed(0)
    model = LlamaForSequenceClassification.from_pretrained(
        source, num_labels=3, torch_dtype=torch.float32
    )
    with torch.no_grad():  # a head large enough that the classes differ clearly
        model.score.weight.normal_(0.0, 0.25)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def reward_model(folder: Path) -> Path:
    """A tiny Qwen2 (seeded random weights, the tiny Llama's sizes and tokenizer) with a seeded
    two-layer score head, saved as Qwen2ForRewardModel: vLLM runs it as a reward model, one
    score per token (`token_classify`, ALL pooling). `problem_type: regression` keeps the raw
    scores (no activation), as reward models report them."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    source = tinymodels.build("llama")
    base = json.loads((source / "config.json").read_text())
    sizes = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "initializer_range",
    ]
    config = Qwen2Config(**{k: base[k] for k in sizes}, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    h = config.hidden_size
    weights = load_file(folder / "model.safetensors")
    weights["score.0.weight"] = torch.randn(h, h) / h**0.5
    weights["score.0.bias"] = 0.1 * torch.randn(h)
    weights["score.2.weight"] = torch.randn(1, h) / h**0.5
    weights["score.2.bias"] = 0.1 * torch.randn(1)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((folder / "config.json").read_text())
    meta.update(architectures=["Qwen2ForRewardModel"], problem_type="regression", num_labels=1)
    (folder / "config.json").write_text(json.dumps(meta))
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def hf_token_rewards(model: str, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt token's reward: transformers' final hidden states of the Qwen2 base model,
    through the checkpoint's score head (linear, ReLU, linear) in float64."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model, torch_dtype=torch.float32).eval()
    head = {k: w.double() for k, w in load_file(Path(model) / "model.safetensors").items()}
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = hf(input_ids=torch.tensor([prompt])).last_hidden_state[0].double()
            mid = torch.relu(hidden @ head["score.0.weight"].T + head["score.0.bias"])
            out.append((mid @ head["score.2.weight"].T + head["score.2.bias"])[:, 0].tolist())
    return out


def hf_class_probabilities(model: str, prompts: list[list[int]]) -> list[list[float]]:
    """transformers' class probabilities (softmax of the score head on the last token), one
    prompt at a time."""
    import torch
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(model, torch_dtype=torch.float32)
    with torch.no_grad():
        return [
            hf.eval()(input_ids=torch.tensor([p])).logits[0].softmax(-1).tolist() for p in prompts
        ]


def hf_embeddings(model: str, prompts: list[list[int]], pooling: str) -> list[list[float]]:
    """transformers' final hidden states, pooled (`last` token or `mean` over the prompt) and
    L2-normalised, one prompt at a time (no padding)."""
    import torch
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = hf(input_ids=torch.tensor([prompt])).last_hidden_state[0]
            pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).tolist())
    return out


@pytest.fixture(scope="module")
def references(models, prompts) -> dict[str, list[list[float]]]:
    return {
        "llama": hf_embeddings(models["llama"], prompts, "last"),
        "bert": hf_embeddings(models["bert"], prompts, "mean"),
        "classifier": hf_class_probabilities(models["classifier"], prompts),
        "reward": hf_token_rewards(models["reward"], prompts),
    }


@pytest.fixture(scope="module")
def offline(models, prompts) -> dict[str, dict]:
    """The offline cases (both embedding models, the classifier, the reward model), run in one
    job process."""
    cases = {
        "llama": {"model": models["llama"], "prompts": prompts, "engine": ENGINE},
        "bert": {
            "model": models["bert"],
            "prompts": prompts,
            "engine": ENGINE,
            "pooler": BERT_POOLER,
            # The compile cases' fitted plan, made from a generation trace: its prompt buckets
            # have context blocks, which an encoder's packed rows (no context) are padded to. An
            # encoder-only layer branches on packing there too, so such a row needs a graph of
            # its own (hpu_graphs.packing_matters). The served BERT keeps exp's default plan.
            "env": fitted_plan_env(),
        },
        "classifier": {
            "model": models["classifier"],
            "prompts": prompts,
            "engine": ENGINE,
            "task": "classify",
        },
        "reward": {
            "model": models["reward"],
            "prompts": prompts,
            "engine": ENGINE,
            "task": "reward",
        },
    }
    proc = run_job(JOB, json.dumps({"cases": cases}), timeout=900)
    results = named_job_outputs(proc)
    for name in cases:
        result = results.get(name)
        if result is None or "error" in result:
            pytest.fail(
                f"pooling job case {name}: {result}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            )
    return results


def max_error(ours: list[list[float]], ref: list[list[float]]) -> float:
    import torch

    assert len(ours) == len(ref)
    return max(float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(ours, ref))


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_offline_embeddings_of_mixed_length_batch_equal_transformers(offline, references, name):
    err = max_error(offline[name]["together"], references[name])
    print(f"{name} offline, together: largest embedding difference {err:.2e}")
    assert err < TOLERANCE, f"largest embedding difference {err:.2e}"


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_offline_embeddings_of_single_prompts_equal_transformers(offline, references, name):
    err = max_error(offline[name]["alone"], references[name])
    print(f"{name} offline, alone: largest embedding difference {err:.2e}")
    assert err < TOLERANCE, f"largest embedding difference {err:.2e}"


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_offline_pooling_model_runs_no_shape_after_warmup_that_warmup_did_not(offline, name):
    stats = offline[name]["stats"]
    assert stats["warmup_seconds"] is not None
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]


def test_warmup_and_serving_never_call_compute_logits_of_a_pooling_model(offline):
    # The Llama embedding model keeps LlamaForCausalLM's compute_logits (the guard replaced it
    # with one that counts and raises); BERT has none. Reward and classifier models are
    # guarded too.
    assert offline["llama"]["compute_logits"]["present"]
    assert not offline["bert"]["compute_logits"]["present"]
    calls = {name: result["compute_logits"]["calls"] for name, result in offline.items()}
    assert calls == dict.fromkeys(calls, 0)


@pytest.fixture(scope="module", params=["bert", "llama"])
def server(request, models, clean_env, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(model name, base URL) of `vllm serve` (the OpenAI server module) running one embedding
    model: the tiny BERT (mean pooling) or the tiny Llama (its default, the last token). Module
    scope and parametrised: pytest stops one server before starting the next."""
    name = request.param
    log = tmp_path_factory.mktemp(f"serve-pooling-{name}") / "server.log"
    args = ["--model", models[name], "--runner", "pooling"]
    if name == "bert":
        args += ["--pooler-config", json.dumps(BERT_POOLER)]
    args += [
        "--dtype",
        "float32",
        "--max-model-len",
        str(ENGINE["max_model_len"]),
        "--max-num-batched-tokens",
        str(ENGINE["max_num_batched_tokens"]),
        "--kv-cache-memory-bytes",
        str(ENGINE["kv_cache_memory_bytes"]),
    ]
    start = time.monotonic()
    with openai_server.running(args, openai_server.server_env(clean_env()), log) as base:
        print(f"{name} server healthy after {time.monotonic() - start:.0f} s")
        yield name, base


def embed_over_http(base: str, model: str, prompts: list[list[int]]) -> list[list[float]]:
    resp = httpx.post(
        f"{base}/v1/embeddings",
        json={"model": model, "input": prompts},
        timeout=120,
        trust_env=False,
    )
    assert resp.status_code == 200, resp.text
    data = sorted(resp.json()["data"], key=lambda item: item["index"])
    return [item["embedding"] for item in data]


def test_v1_embeddings_of_mixed_length_batch_equal_transformers(
    server, models, prompts, references
):
    name, base = server
    ours = embed_over_http(base, models[name], prompts)
    err = max_error(ours, references[name])
    print(f"{name} /v1/embeddings, together: largest embedding difference {err:.2e}")
    assert err < TOLERANCE, f"largest embedding difference {err:.2e}"


def test_v1_embeddings_of_single_prompts_equal_transformers(server, models, prompts, references):
    name, base = server
    ours = [embed_over_http(base, models[name], [p])[0] for p in prompts]
    err = max_error(ours, references[name])
    print(f"{name} /v1/embeddings, alone: largest embedding difference {err:.2e}")
    assert err < TOLERANCE, f"largest embedding difference {err:.2e}"


def test_served_embedding_model_runs_no_shape_after_warmup_that_warmup_did_not(server):
    _, base = server
    resp = httpx.post(
        f"{base}/collective_rpc",
        json={"method": "get_recompile_stats"},
        timeout=60,
        trust_env=False,
    )
    assert resp.status_code == 200, resp.text
    stats = resp.json()["results"][0]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["warmup_seconds"] is not None


def test_offline_class_probabilities_of_mixed_length_batch_equal_transformers(offline, references):
    err = max_error(offline["classifier"]["together"], references["classifier"])
    print(f"classifier offline, together: largest probability difference {err:.2e}")
    assert err < TOLERANCE, f"largest probability difference {err:.2e}"


def test_offline_class_probabilities_of_single_prompts_equal_transformers(offline, references):
    err = max_error(offline["classifier"]["alone"], references["classifier"])
    print(f"classifier offline, alone: largest probability difference {err:.2e}")
    assert err < TOLERANCE, f"largest probability difference {err:.2e}"


def test_classification_model_runs_no_shape_after_warmup_that_warmup_did_not(offline):
    stats = offline["classifier"]["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]


def test_offline_token_rewards_of_mixed_length_batch_equal_the_reference(offline, references):
    rewards = offline["reward"]["together"]
    assert [len(r) for r in rewards] == [len(r) for r in references["reward"]]  # one per token
    err = max_error(rewards, references["reward"])
    print(f"reward offline, together: largest reward difference {err:.2e}")
    assert err < TOLERANCE, f"largest reward difference {err:.2e}"


def test_offline_token_rewards_of_single_prompts_equal_the_reference(offline, references):
    err = max_error(offline["reward"]["alone"], references["reward"])
    print(f"reward offline, alone: largest reward difference {err:.2e}")
    assert err < TOLERANCE, f"largest reward difference {err:.2e}"


def test_reward_model_runs_no_shape_after_warmup_that_warmup_did_not(offline):
    stats = offline["reward"]["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
