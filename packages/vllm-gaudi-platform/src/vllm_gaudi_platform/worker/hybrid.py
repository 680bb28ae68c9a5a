"""Models with state layers beside attention (Mamba2: Granite 4.0-H, ...; gated delta net:
Qwen3-Next, Qwen3.5): what the runner does differently for them.

vLLM's hybrid KV-cache manager gives such a model one KV-cache group per layer kind: the
attention layers' paged blocks, and per request one state slot per Mamba layer (conv and SSM
state), both in pages of one size; with prefix caching, one slot per block of tokens, of which
the last holds the running state. The step layout, the bucket plan and the block arithmetic
follow the attention groups; the Mamba layers read their slots through their own metadata
(`vllm_gaudi_ops.mamba`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata
from vllm_gaudi_platform.bucketing import BucketPlan

logger = init_logger(f"vllm.{__name__}")

PROMPT_BS_MAX = "VLLM_PROMPT_BS_BUCKET_MAX"


def is_mamba_hybrid(model_config: Any) -> bool:
    """A model with Mamba state layers beside its attention layers (Granite 4.0-H, ...)."""
    return model_config is not None and bool(model_config.is_hybrid)


def check_vllm_config(vllm_config: Any) -> bool:
    """The platform's config check for Mamba hybrids (before any engine starts): True for one.

    With prefix caching, Mamba state is cached at block boundaries (vLLM's mamba_cache_mode
    "align"): the scheduler ends prefill chunks there, vLLM's runner copies a request's state into
    the block of its last token before each step (`mamba_state_copies.py`) and the HPU mixer reads
    and writes that block (`attention/mamba_state.py`). Speculative decoding is refused (a request's
    state would advance past its rejected draft tokens)."""
    model_config = vllm_config.model_config
    if not is_mamba_hybrid(model_config):
        return False
    if vllm_config.speculative_config is not None:
        raise ValueError(
            f"speculative decoding is not supported on HPU for {model_config.architecture} (a "
            "Mamba2 hybrid): its Mamba state would advance past rejected draft tokens; remove "
            "speculative_config (--speculative-config)."
        )
    cache_config = vllm_config.cache_config
    if cache_config.enable_prefix_caching:
        if not vllm_config.scheduler_config.enable_chunked_prefill:
            raise ValueError(
                f"prefix caching of {model_config.architecture}'s Mamba state needs chunked "
                "prefill (prefill chunks end at block boundaries, where states are cached): "
                "enable chunked prefill, or disable prefix caching (--no-enable-prefix-caching)."
            )
        cache_config.mamba_cache_mode = "align"
        cache_config.mamba_block_size = cache_config.block_size  # aligned again with the pages
    else:
        cache_config.mamba_cache_mode = "none"
        cache_config.mamba_block_size = model_config.max_model_len
    return True


def state_tensors(runner: Any) -> list[Any]:
    """The conv and SSM state tensors of every Mamba layer of the runner's model."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    context = runner.compilation_config.static_forward_context
    return [
        state
        for layer in context.values()
        if isinstance(layer, MambaBase)
        for state in layer.kv_cache
        if isinstance(state, torch.Tensor)
    ]


def attention_block_size(groups: list[Any]) -> int:
    """Block size of the first group with paged attention blocks (a Mamba group's block size
    counts tokens per state slot, not per page of keys and values)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    for group in groups:
        if not isinstance(group.kv_cache_spec, MambaSpec):
            return int(group.kv_cache_spec.block_size)
    return int(groups[0].kv_cache_spec.block_size)


# The state-space layers the ops wheel runs on HPU: vLLM's layer class -> its op family's entry
# point (the layer is replaced when that entry point is installed and loaded).
STATE_LAYER_FAMILIES = {
    "MambaMixer2": "hpu_ops_mamba",
    "QwenGatedDeltaNetAttention": "hpu_ops_gdn",
}


def check_state_layers(model: Any) -> None:
    """Refuse a model whose state-space layers have no HPU implementation, naming them and the
    fix: vLLM's own would run CUDA (Triton) kernels on their first step."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    from vllm_gaudi_platform.attention.mamba_state import HPUStateBackend

    missing = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if isinstance(m, MambaBase) and not issubclass(m.get_attn_backend(), HPUStateBackend)
        }
    )
    if not missing:
        return
    fixes = [
        f"{name} needs the op family {STATE_LAYER_FAMILIES[name]} (install vllm-gaudi-ops, and "
        f"keep {STATE_LAYER_FAMILIES[name]} in VLLM_PLUGINS if you set it)"
        for name in missing
        if name in STATE_LAYER_FAMILIES
    ]
    unbuilt = [name for name in missing if name not in STATE_LAYER_FAMILIES]
    if unbuilt:
        fixes.append(
            f"{', '.join(unbuilt)}: these state-space layers (Mamba1, short conv, ...) have no "
            "HPU kernels yet; serve this model on another platform"
        )
    raise ValueError(f"{', '.join(missing)} layers have no HPU implementation: {'; '.join(fixes)}.")


STATE_FIELDS = (
    "state_slots_prefill",
    "state_lens_prefill",
    "state_initial_prefill",
    "state_slots_decode",
    "state_initial_decode",
    "state_packed",
)


def is_state_group(group: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(group.kv_cache_spec, MambaSpec)


def has_state_layers(runner: Any) -> bool:
    """Whether the runner's model has state-space (Mamba) layers: known once the KV cache
    exists."""
    config = getattr(runner, "kv_cache_config", None)
    return config is not None and any(is_state_group(g) for g in config.kv_cache_groups)


def for_group(metadata: HPUAttentionMetadata, group: Any) -> HPUAttentionMetadata:
    """Warmup's metadata as one KV-cache group's layers read it: state slots for a Mamba
    group, none for an attention group (whose serving steps have none either, which the
    graphs' static buffers must match)."""
    if is_state_group(group) or metadata.state_slots_prefill is metadata.state_slots_decode:
        return metadata
    cleared: dict[str, Any] = dict.fromkeys(STATE_FIELDS)
    return dataclasses.replace(metadata, **cleared)


# Prompts per prefill step a model with state-space layers gets buckets for, unless the operator
# sets VLLM_PROMPT_BS_BUCKET_MAX: its prompts cannot share a row, so a step of several prompts
# needs a bucket with that many rows (a step with more runs in passes of rows buckets hold:
# step_layout.split_passes).
STATE_PROMPT_ROWS = 4


def plan_environ(state_layers: bool, max_num_seqs: int) -> Mapping[str, str] | None:
    """The environment the bucket plan is read from: the process's, with more prompt rows by
    default for a model with state-space layers."""
    if not state_layers or os.environ.get(PROMPT_BS_MAX):
        return None
    return {**os.environ, PROMPT_BS_MAX: str(min(STATE_PROMPT_ROWS, max_num_seqs))}


def plan_without_packing(plan: BucketPlan) -> BucketPlan:
    """The bucket plan of a model with state-space layers: each prompt in its own row."""
    return dataclasses.replace(plan, pack_prefills=False)
