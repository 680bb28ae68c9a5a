"""The trained tiny Llama's corpus split, cache and training determinism, without an engine.

Training itself is exercised with a shrunken recipe (a few steps of a tiny model), so these
tests take seconds; the full model is checked end to end in tests/integration/test_trained_model.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_gaudi_platform.commands import demo_model

SMALL_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
SMALL_RECIPE = {"steps": 3, "warmup_steps": 1, "batch_size": 2, "seq_len": 32, "eval_windows": 2}


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe and a corpus slice that train in a second or two (they change the cache key)."""
    head = demo_model.paragraphs()[:300]
    monkeypatch.setattr(demo_model, "paragraphs", lambda: head)
    monkeypatch.setattr(demo_model, "CONFIG", {**demo_model.CONFIG, **SMALL_CONFIG})
    monkeypatch.setattr(demo_model, "RECIPE", {**demo_model.RECIPE, **SMALL_RECIPE})


def test_heldout_paragraphs_are_not_in_the_training_text():
    train, heldout = demo_model.split()
    held = heldout.split("\n\n")
    assert len(held) > 100
    assert len(train) > 10 * len(heldout)
    train_paragraphs = set(train.split("\n\n"))
    # Topics repeat each other's sections: a duplicate must not sit on both sides.
    assert not [p for p in held if p in train_paragraphs]


def test_heldout_prompts_are_prose_from_the_heldout_text():
    heldout = demo_model.split()[1]
    prompts = demo_model.heldout_prompts(count=4, words=6)
    assert len(prompts) == 4
    for prompt in prompts:
        assert len(prompt.split()) == 6 and prompt[0].isupper()
        assert prompt in heldout


def test_cache_key_changes_with_the_recipe(monkeypatch: pytest.MonkeyPatch):
    before = demo_model.cache_key()
    monkeypatch.setitem(demo_model.RECIPE, "steps", demo_model.RECIPE["steps"] + 1)
    assert demo_model.cache_key() != before


def test_perplexity_is_exp_of_the_mean_negative_logprob():
    assert demo_model.perplexity([[-1.0, -3.0], [-2.0]]) == pytest.approx(2.718281828**2)
    with pytest.raises(ValueError, match="at least one"):
        demo_model.perplexity([[]])


@pytest.mark.process  # trains in a process of its own
def test_training_with_the_same_seed_gives_identical_weights(small, tmp_path: Path):
    first = demo_model.build(root=tmp_path / "a", progress=False)
    second = demo_model.build(root=tmp_path / "b", progress=False)
    assert first.name == second.name
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert demo_model.metrics(first)["train_loss"] == demo_model.metrics(second)["train_loss"]


@pytest.mark.process  # trains in a process of its own
def test_the_weights_do_not_depend_on_the_thread_count(
    small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Full width (one layer): narrow matrices would not be split across threads at all.
    wide = {k: demo_model.CONFIG[k] for k in ("hidden_size", "intermediate_size")}
    monkeypatch.setattr(demo_model, "CONFIG", {**demo_model.CONFIG, **wide})
    built = []
    for threads in (1, 2):
        monkeypatch.setattr(demo_model, "training_threads", lambda n=threads: n)
        built.append(demo_model.build(root=tmp_path / str(threads), progress=False))
    assert [demo_model.metrics(p)["train_threads"] for p in built] == [1, 2]
    one, two = ((p / "model.safetensors").read_bytes() for p in built)
    assert one == two


@pytest.mark.process  # trains in a process of its own
def test_the_weights_do_not_depend_on_the_kernels_the_caller_asks_for(
    small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A caller whose environment asks for AVX-512 kernels (what an AVX-512 machine runs by
    # default, and what made its weights differ from an AVX2 machine's) trains the same bytes as
    # one that asks for AVX2: the training process pins its own kernels. On an AVX-512 machine
    # both kernel sets exist, so this compares them; on an AVX2-only one both runs are AVX2.
    asks = {
        "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        "AVX512": {
            "ATEN_CPU_CAPABILITY": "avx512",
            "MKL_CBWR": "AVX512",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512",
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        },
    }
    built = []
    for isa, env in asks.items():
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            built.append(demo_model.build(root=tmp_path / isa, progress=False))
    avx2, avx512 = ((p / "model.safetensors").read_bytes() for p in built)
    assert avx2 == avx512
    assert demo_model.metrics(built[1])["kernels"] == demo_model.pinned_kernels()


def test_training_refuses_to_run_on_other_kernels_than_the_pinned_ones(
    monkeypatch: pytest.MonkeyPatch,
):
    import torch

    pinned = dict(demo_model.PINNED_KERNELS_X86)
    monkeypatch.setattr(demo_model, "pinned_kernels", lambda: pinned)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(RuntimeError, match="AVX2 kernels"):
        demo_model._check_pinned_kernels()


def test_training_uses_one_thread_on_a_busy_machine(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(demo_model.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(demo_model.os, "getloadavg", lambda: (1.8, 1.0, 1.0))
    assert demo_model.training_threads() == 1
    monkeypatch.setattr(demo_model.os, "getloadavg", lambda: (0.1, 1.0, 1.0))
    assert demo_model.training_threads() == 2


@pytest.mark.process  # trains in a process of its own
def test_a_cached_model_is_returned_without_training(
    small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = demo_model.build(root=tmp_path, progress=False)

    def fail(*args, **kwargs):
        raise AssertionError("trained again although the model was cached")

    monkeypatch.setattr(demo_model, "_train_into", fail)
    assert demo_model.build(root=tmp_path, progress=False) == path


def test_interrupted_training_leaves_no_model_behind(
    small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def interrupted(path: Path, *, progress: bool) -> None:
        (path / "config.json").write_text("{}")  # half written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_model, "_train_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo_model.build(root=tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
