"""A step run as several forward passes, each on a warmed bucket (the layout's parts,
`step_layout.split_passes`: a mixed prefill + decode step, or prompts in groups of rows), with
its hidden states merged back in the step's token order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from vllm.forward_context import get_forward_context

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata


def _scatter_tokens(out: Any, tokens: torch.Tensor, total: int, into: Any = None) -> Any:
    """Write one pass's forward output (hidden states, or EAGLE-3's (hidden, [aux...])) rows
    0..len(tokens) to rows `tokens` of `into`, a zero tensor of the step's padded token count
    made on first use."""
    if isinstance(out, torch.Tensor):
        if into is None:
            into = out.new_zeros((total, *out.shape[1:]))
        into[tokens] = out[: tokens.shape[0]]
        return into
    if isinstance(out, (tuple, list)):
        targets = into if into is not None else [None] * len(out)
        return type(out)(_scatter_tokens(o, tokens, total, t) for o, t in zip(out, targets))
    raise TypeError(f"unexpected forward output {type(out).__name__} in a step run in passes")


def forward_in_parts(
    runner: Any,
    layout: step_layout.StepLayout,
    inputs: dict[str, torch.Tensor | None],
    eager: Callable[..., Any],
) -> Any:
    """A step as several forward passes (prefill passes, then the decode pass), each replaying
    its bucket's graph (or eager without one); None when the step's metadata was not built in
    parts (then the step runs as one pass).

    `inputs` are the step's token inputs by keyword: `input_ids` (None for a model that takes
    embeddings), `positions` (1-D, or M-RoPE's 3 rows) and `inputs_embeds` (a multimodal model's,
    else None). Each pass reads its own tokens at the
    front of vLLM's persistent buffers (where its graph was captured); the buffers get the
    step's tokens back afterwards, since vLLM reads them again (drafting). The hidden states
    come back in the step's token order, padding rows zero, so vLLM's logits and pooling indices
    are unchanged. Other per-token buffers the runner names (`token_side_buffers`: LoRA's
    adapter slots) are rearranged the same way. `eager` runs a pass that has no graph (the base
    runner's `_model_forward`); `runner` is the HPUModelRunner.
    """
    context = get_forward_context()
    step_md = context.attn_metadata
    split = layout.parts
    assert isinstance(step_md, dict) and split is not None
    if any(not isinstance(md, HPUAttentionMetadata) or md.parts is None for md in step_md.values()):
        return None
    positions = inputs["positions"]
    assert positions is not None
    # Each buffer's token axis: the last for positions (M-RoPE's are [3, tokens]), else the first.
    buffers = {
        name: (tensor, tensor.dim() - 1 if name == "positions" else 0)
        for name, tensor in inputs.items()
        if tensor is not None
    }
    saved = {name: tensor.clone() for name, (tensor, _) in buffers.items()}
    step_tokens = positions.shape[-1]
    # LoRA's adapter slots per token: each pass reads its own tokens' at the front.
    side = [(buf, pad, buf.clone()) for buf, pad in runner.token_side_buffers()]
    saved_padding = context.is_padding
    passes = tuple((one.layout, one.tokens) for one in split.passes)
    merged: Any = None
    try:
        # The step's padding mask (vLLM's MoE may skip padded tokens) is for one pass.
        context.is_padding = None
        for index, (part, token_list) in enumerate(passes):
            tokens = torch.tensor(token_list, dtype=torch.int64, device=positions.device)
            n, total = len(token_list), part.num_tokens_padded
            views: dict[str, torch.Tensor | None] = dict.fromkeys(inputs)
            for name, (tensor, axis) in buffers.items():
                view = tensor.narrow(axis, 0, total)
                view.narrow(axis, 0, n).copy_(saved[name].index_select(axis, tokens))
                view.narrow(axis, n, total - n).zero_()
                views[name] = view
            for buf, pad, saved_side in side:
                buf[..., :n] = saved_side[..., tokens]
                buf[..., n:total] = pad
            part_md = {name: md.parts[index] for name, md in step_md.items()}
            context.attn_metadata = part_md  # type: ignore[assignment]
            step_layout.set_current(part)
            entry = runner.graphs.lookup(part, part_md)
            if entry is not None:
                inputs_for = functools.partial(
                    runner._graph_inputs,
                    views["input_ids"],
                    views["positions"],
                    inputs_embeds=views["inputs_embeds"],
                )
                out = runner.graphs.replay(entry, part_md, inputs_for)
            else:
                out = eager(**views)
            merged = _scatter_tokens(out, tokens, step_tokens, merged)
    finally:
        context.attn_metadata = step_md
        context.is_padding = saved_padding
        step_layout.set_current(layout)
        for name, (tensor, _) in buffers.items():
            tensor.copy_(saved[name])
        for buf, _, saved_side in side:
            buf.copy_(saved_side)
    runner.split_steps += 1
    return merged
