"""A tiny Llama that has learned real text, trained locally on first use: no model hub needed.

The random-weight models of the tests (`gaudi_testkit.tinymodels`) test architectures; their
output is noise, and they have no accuracy to lose. This model is trained for about three
minutes on a 2-core CPU, so its greedy output reads as words and phrases of its corpus and its
held-out perplexity is a number worth comparing (HPU platform vs transformers, quantized vs
float).

Corpus: the Python documentation topics that ship with CPython as `pydoc_data.topics` (the text
`help()` shows for keywords and topics), present on every machine with Python, no download.
Provenance and license: generated from the CPython documentation, Copyright Python Software
Foundation, distributed under the PSF License Agreement (Python Software Foundation License
Version 2); code examples in the documentation are additionally under the Zero-Clause BSD
license. The corpus differs slightly between Python releases, so its hash is part of the cache
key: each Python version trains (once) its own model.

Split: the topics are cut into distinct paragraphs (blank-line separated, duplicates across
topics dropped); every HELDOUT_EVERY-th paragraph is held out, the rest is training text. The
byte-level BPE tokenizer (`tokenizers`) is trained on the training text only.

Determinism: the same bytes on every x86-64 machine, whatever its instruction set, thread count
or load. Training runs in a fresh interpreter (nothing the calling process set, such as vLLM's
thread and oneDNN settings, reaches it) whose kernels are pinned to the AVX2 code paths every
x86-64 machine we support has (`PINNED_KERNELS`: torch's own vectorized kernels, MKL's
conditional numerical reproducibility branch in its strict mode, oneDNN's ISA cap), with fixed
seeds for the weights and the batch order and `torch.use_deterministic_algorithms`. Without the
pin, an AVX-512 machine runs wider kernels that sum in another order: its weights differed from
an AVX2 machine's, and even between 1 and 2 threads. Without the strict mode, MKL's branch is
reproducible only at a fixed thread count: on an AVX-512 machine with AMX, 1 and 2 threads gave
other bytes. The unit tests check 1 and 2 threads, and a parent environment that
asks for AVX-512 kernels, against the same bytes. Elsewhere than x86-64 nothing is pinned (the
pin's settings are part of the cache key, so such a machine trains and caches its own model).

Recipe: at a budget of a few CPU minutes, a small model that sees many tokens beats a bigger one
that sees few. 2 layers of width 128 (0.66 M weights, 40 % of them the tied embedding), 1200
steps of 8 x 128 tokens (10 passes over the 100 k training tokens), peak learning rate 3e-3:
held-out perplexity 55.4 (1.60 bits per byte), where an interpolated bigram model of the same
tokens scores 75.8 and unigram frequencies 524 (1500 steps: 52.3, 25 % more time). The previous
recipe (4 layers of width 192, 400 steps, lr 5e-3) cost 3x as much per token and reached 137
(1.96 bits per byte): it stopped long before it had learned even the bigram statistics.

Speed: a step costs 0.20 s of one core (CPU time, 1 thread), 240 s for the 1200 steps; two idle
cores should bring that to about 2.5 minutes (the earlier model's steps took 0.58x as long on
two threads as on one), plus 12 s for the tokenizer. Measured: 296 s on one thread at low
priority beside other jobs (load 2.5 to 4). On a busy machine two OpenMP threads are much worse
than one: every one of the hundreds of small parallel regions in a step waits at a barrier for
a thread the kernel has descheduled; a 16 x 128 step of the earlier, larger model measured at
0.56 s idle took 9 s beside other CPU-bound processes, one thread 6 s. So training uses as many
threads (at most MAX_TRAIN_THREADS) as there are idle cores.

Cache: the model is saved under `envs.model_cache()` in a folder named by a hash of the model
config, seed, corpus and training recipe, so a second run starts at once. It is built in a
temporary folder and renamed into place when complete, under a file lock, so an interrupted
training never leaves a half model that loads and two processes never train it twice.

torch, transformers, tokenizers and tqdm are imported lazily: the platform wheel does not depend
on them (they come with vLLM).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_gaudi_platform.envs import model_cache

CORPUS_SOURCE = "pydoc_data.topics (CPython documentation, PSF License Version 2)"
HELDOUT_EVERY = 20
# Engine settings under which the trained model's perplexity is measured (the tests and
# benchmarks/quant_perplexity.py): full precision, room for one window per sequence.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 64 << 20,
    "seed": 0,
}
VOCAB_SIZE = 2048
SEED = 0
MAX_TRAIN_THREADS = 2

CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# Everything that changes the weights is in here (and in the cache key).
RECIPE: dict[str, Any] = {
    "steps": 1200,
    "batch_size": 8,
    "seq_len": 128,
    "peak_lr": 3e-3,
    "final_lr_fraction": 0.1,
    "warmup_steps": 20,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "grad_clip": 1.0,
    "eval_windows": 32,
}

# Bump when the way the folder is written changes (file names, tokenizer settings).
FORMAT_VERSION = 1
# The kernel paths training runs on, on x86-64: each is read by its library when it loads, so they
# are set in the training process's environment before torch is imported (see the docstring).
PINNED_KERNELS_X86 = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorized CPU kernels
    # MKL's conditional numerical reproducibility: the AVX2 branch, the same at any thread count
    "MKL_CBWR": "AVX2,STRICT",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_DYNAMIC": "FALSE",  # exactly the threads asked for
}
SPEC_FILE = "training-spec.json"  # the parent's orders to the training process; removed after
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
METRICS_FILE = "training.json"  # written last: its presence marks a complete model


def paragraphs() -> list[str]:
    """The corpus as distinct paragraphs, in a fixed order (topics sorted by name).

    Many topics repeat sections of others; each paragraph is kept once (first occurrence), so no
    held-out paragraph also appears in the training text.
    """
    from pydoc_data.topics import topics

    out: dict[str, None] = {}
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            text = "\n".join(line.rstrip() for line in block.strip("\n").splitlines())
            if text.strip():
                out.setdefault(text)
    return list(out)


def split() -> tuple[str, str]:
    """(training text, held-out text): every HELDOUT_EVERY-th paragraph is held out."""
    train: list[str] = []
    heldout: list[str] = []
    for i, para in enumerate(paragraphs()):
        (heldout if i % HELDOUT_EVERY == HELDOUT_EVERY // 2 else train).append(para)
    return "\n\n".join(train), "\n\n".join(heldout)


def pinned_kernels() -> dict[str, str]:
    """The environment that pins training's kernels on this machine (empty off x86-64)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return dict(PINNED_KERNELS_X86)
    return {}


def cache_key() -> str:
    """Hash of everything the weights depend on: config, seed, corpus, recipe, kernels, format."""
    train, heldout = split()
    corpus = hashlib.sha256((train + "\x00" + heldout).encode()).hexdigest()
    blob = json.dumps(
        [
            CONFIG,
            SEED,
            RECIPE,
            corpus,
            HELDOUT_EVERY,
            SPECIAL_TOKENS,
            FORMAT_VERSION,
            pinned_kernels(),
        ],
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build(*, root: Path | None = None, progress: bool = True) -> Path:
    """Path of the trained model, training and caching it on first use (about 3 min, 2 cores).

    Returns at once when the cached folder exists. `progress` shows a tqdm bar with the loss.
    """
    root = root or model_cache()
    path = root / f"trained-llama-{cache_key()}"
    if (path / METRICS_FILE).exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{path.name}.lock"):
        if (path / METRICS_FILE).exists():  # another process trained it while we waited
            return path
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _train_into(tmp, progress=progress)
            tmp.rename(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def metrics(path: Path) -> dict[str, Any]:
    """The training record saved beside the model (losses, perplexities, time)."""
    return json.loads((path / METRICS_FILE).read_text())


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _train_tokenizer(text: str, path: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    return fast


def training_threads() -> int:
    """Threads for training: the idle cores (by the 1-minute load average), 1 to MAX_TRAIN_THREADS.

    Oversubscribed OpenMP threads stall at every barrier (see the module docstring), so on a
    busy machine one thread trains several times faster than two.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    idle = (cores or 1) - os.getloadavg()[0]
    return max(1, min(MAX_TRAIN_THREADS, int(idle + 0.5)))


@contextlib.contextmanager
def _training_determinism(threads: int) -> Iterator[None]:
    """Deterministic kernels and the given thread count for the block; the caller's settings are
    restored afterwards (vLLM sets its own thread count later in the same process)."""
    import torch

    saved_threads = torch.get_num_threads()
    saved_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved_det)
        torch.set_num_threads(saved_threads)


def _lr(step: int, recipe: dict[str, Any]) -> float:
    peak, warm, steps = recipe["peak_lr"], recipe["warmup_steps"], recipe["steps"]
    if step < warm:
        return peak * (step + 1) / warm
    floor = peak * recipe["final_lr_fraction"]
    progress = (step - warm) / max(1, steps - warm)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _mean_loss(model: Any, windows: Any) -> float:
    import torch

    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    return sum(losses) / len(losses)


def training_env(threads: int) -> dict[str, str]:
    """The training process's environment: this one's, with the kernels and threads pinned."""
    env = dict(os.environ)
    env.update(pinned_kernels())
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def _train_into(path: Path, *, progress: bool) -> None:
    """Train the model into `path` in a fresh interpreter with pinned kernels (module docstring)."""
    train_text, heldout_text = split()
    threads = training_threads()
    spec = {
        "config": CONFIG,
        "recipe": RECIPE,
        "seed": SEED,
        "threads": threads,
        "progress": progress,
        "train_text": train_text,
        "heldout_text": heldout_text,
    }
    (path / SPEC_FILE).write_text(json.dumps(spec))
    result = subprocess.run(
        [sys.executable, "-m", __name__, str(path)], env=training_env(threads), check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"training the tiny Llama failed (exit status {result.returncode}); the training "
            "process's own error is printed above"
        )
    (path / SPEC_FILE).unlink()


def _check_pinned_kernels() -> None:
    """In the training process: refuse to train on kernels other than the pinned ones (a CPU
    without AVX2 would silently fall back to others and give other bytes)."""
    import torch

    wanted = pinned_kernels().get("ATEN_CPU_CAPABILITY")
    found = torch.backends.cpu.get_cpu_capability()
    if wanted is not None and found.lower() != wanted:
        raise RuntimeError(
            f"the tiny Llama trains on {wanted.upper()} kernels for identical bytes on every "
            f"x86-64 machine, but torch runs {found} kernels here (a CPU without AVX2?)"
        )


def _train(path: Path, spec: dict[str, Any]) -> None:
    """The training itself (in the training process): tokenizer, model, metrics record."""
    import torch
    import transformers
    from tqdm.auto import tqdm

    _check_pinned_kernels()
    recipe, seed, threads = spec["recipe"], spec["seed"], spec["threads"]
    train_text, heldout_text = spec["train_text"], spec["heldout_text"]
    tokenizer = _train_tokenizer(train_text, path)
    train_ids = torch.tensor(tokenizer(train_text)["input_ids"], dtype=torch.long)
    heldout_ids = torch.tensor(tokenizer(heldout_text)["input_ids"], dtype=torch.long)
    seq, batch = recipe["seq_len"], recipe["batch_size"]

    started = time.monotonic()
    with _training_determinism(threads):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**spec["config"])
        model = transformers.LlamaForCausalLM(config).float().train()
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": recipe["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=recipe["peak_lr"],
            betas=tuple(recipe["betas"]),
        )
        order = torch.Generator().manual_seed(seed + 1)
        bar = tqdm(
            range(recipe["steps"]),
            desc="Training the tiny Llama on the Python docs",
            disable=not spec["progress"],
            unit="step",
        )
        smoothed = None
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = _lr(step, recipe)
            starts = torch.randint(0, len(train_ids) - seq, (batch,), generator=order)
            x = torch.stack([train_ids[s : s + seq] for s in starts.tolist()])
            loss = model(input_ids=x, labels=x).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["grad_clip"])
            optimizer.step()
            smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
            bar.set_postfix(loss=f"{smoothed:.3f}")
        bar.close()
        train_seconds = time.monotonic() - started

        model.eval()
        n = recipe["eval_windows"]
        train_loss = _mean_loss(model, _windows(train_ids, n, seq))
        heldout_loss = _mean_loss(model, _windows(heldout_ids, n, seq))
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path, safe_serialization=True)
    record = {
        "corpus": CORPUS_SOURCE,
        "train_tokens": len(train_ids),
        "heldout_tokens": len(heldout_ids),
        "train_seconds": round(train_seconds, 1),
        "train_threads": threads,
        "train_loss": round(train_loss, 4),
        "heldout_loss": round(heldout_loss, 4),
        "train_perplexity": round(math.exp(train_loss), 3),
        "heldout_perplexity": round(math.exp(heldout_loss), 3),
        "config": spec["config"],
        "recipe": recipe,
        "seed": seed,
        "kernels": pinned_kernels(),
    }
    (path / METRICS_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _windows(ids: Any, count: int, length: int) -> list[Any]:
    """The first `count` consecutive non-overlapping windows of `length` tokens."""
    return [ids[i * length : (i + 1) * length] for i in range(min(count, len(ids) // length))]


def heldout_windows(path: Path | str, count: int = 16, length: int = 128) -> list[list[int]]:
    """Held-out token windows for perplexity, tokenized with the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = tokenizer(split()[1])["input_ids"]
    return [list(w) for w in _windows(ids, count, length)]


def heldout_prompts(count: int = 4, words: int = 6) -> list[str]:
    """The first `words` words of the first `count` held-out prose paragraphs."""
    prompts = []
    for para in split()[1].split("\n\n"):
        first = para.split()
        # Prose, not grammar or code: starts with a capital letter, runs on for a while.
        if len(first) >= 2 * words and first[0][:1].isupper() and first[0].isalpha():
            prompts.append(" ".join(first[:words]))
        if len(prompts) == count:
            break
    return prompts


def perplexity(token_logprobs: Sequence[Sequence[float]]) -> float:
    """exp of the mean negative log-likelihood over every token of every sequence."""
    flat = [lp for seq in token_logprobs for lp in seq]
    if not flat:
        raise ValueError("perplexity needs at least one token log-probability")
    return math.exp(-sum(flat) / len(flat))


def transformers_logprobs(path: Path | str, windows: Sequence[Sequence[int]]) -> list[list[float]]:
    """Log-probability of each window token after the first, from transformers in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for window in windows:
            ids = torch.tensor([list(window)])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            out.append(logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def vllm_logprobs(outputs: Sequence[Any]) -> list[list[float]]:
    """Log-probability of each prompt token after the first, from vLLM RequestOutputs generated
    with `SamplingParams(prompt_logprobs=0)` (each position then holds the prompt token)."""
    out = []
    for o in outputs:
        if o.prompt_logprobs is None:
            raise ValueError("the request was not run with SamplingParams(prompt_logprobs=0)")
        pairs = zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)
        out.append([step[token].logprob for token, step in pairs])
    return out


if __name__ == "__main__":
    # The training process of `_train_into`:
    # python -m vllm_gaudi_platform.commands.demo_model <folder>
    from vllm_gaudi_platform.commands import third_party_noise

    third_party_noise.silence()  # it imports transformers, and torchao with it
    _target = Path(sys.argv[1])
    _train(_target, json.loads((_target / SPEC_FILE).read_text()))
