"""Chunked local attention (Llama 4's `attention_chunk_size`): the HPU attention backend has no
chunk-local masks yet, so the platform refuses at start a context longer than one chunk (it would
attend over the whole context: a tiny Llama 4 with chunk 128 and 256-token contexts left
transformers' greedy path on a 145-token prompt at its second token), naming the
--max-model-len that works; and a chunk that is not a multiple of the block size, with the block
size that works (vLLM would start it and stop the engine at its first request with an
AssertionError from its chunking)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_gaudi_platform import config_checks


def _config(
    chunk: int | None, block_size: int = 128, user_block: bool = False, max_model_len: int = 64
) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model="tiny-llama4",
            attention_chunk_size=chunk,
            is_hybrid=False,
            max_model_len=max_model_len,
        ),
        cache_config=SimpleNamespace(block_size=block_size, user_specified_block_size=user_block),
    )


@pytest.mark.parametrize("chunk", [None, 128, 256, 8192])
def test_a_chunk_of_whole_blocks_or_no_chunk_starts(chunk):
    config_checks.check_attention_chunk(_config(chunk, max_model_len=128))  # type: ignore[arg-type]


@pytest.mark.parametrize("max_model_len", [257, 8192])
def test_a_context_longer_than_one_chunk_is_refused_naming_the_length_that_works(max_model_len):
    config = _config(256, max_model_len=max_model_len)
    with pytest.raises(ValueError, match=r"no HPU implementation yet.*--max-model-len 256"):
        config_checks.check_attention_chunk(config)  # type: ignore[arg-type]


@pytest.mark.parametrize(("chunk", "fix"), [(64, "block_size=64"), (96, "block_size=32")])
def test_a_chunk_smaller_than_or_off_the_block_size_is_refused_naming_a_block_size_that_works(
    chunk, fix
):
    with pytest.raises(
        ValueError, match=rf"attention_chunk_size \({chunk}\).*block size \(128\).*{fix}"
    ):
        config_checks.check_attention_chunk(_config(chunk))  # type: ignore[arg-type]


def test_the_refused_fix_starts():
    config_checks.check_attention_chunk(_config(64, block_size=64, user_block=True))  # type: ignore[arg-type]


def test_the_platform_checks_the_chunk_once_the_block_size_is_final(emulated):
    from vllm_gaudi_platform.platform import HpuPlatform

    config = _config(64, block_size=16)  # vLLM's generic default, before the platform's
    with pytest.raises(ValueError, match=r"block size \(128\).*--block-size 64"):
        HpuPlatform.update_block_size_for_backend(config)  # type: ignore[arg-type]
    assert config.cache_config.block_size == 128
