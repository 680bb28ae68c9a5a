"""CPU emulation of the Gaudi device API and fused kernels, in plain torch.

Each function mirrors the Gaudi function of the same name in `gaudi.py`: same arguments, same
layouts, same results (up to floating-point rounding). Emulation never claims to be a Gaudi:
`NAME` says what it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

NAME = "emulated on cpu"
DEVICE_TYPE = "cpu"  # torch device type the tensors live on
IS_EMULATED = True


# ----------------------------------------------------------------------------- device runtime
def torch_device(index: int = 0) -> torch.device:
    return torch.device("cpu")


def device_count() -> int:
    return 1


def device_name(index: int = 0) -> str:
    return "HPU (emulated on cpu)"


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of one emulated HPU: VLLM_HPU_EMULATION_MEMORY_GB caps the total."""
    from vllm_gaudi_platform import envs

    total = int(envs.get_number(envs.VLLM_HPU_EMULATION_MEMORY_GB, lo=0.1) * (1 << 30))
    try:
        import psutil

        total = min(total, psutil.virtual_memory().available)
    except ImportError:
        pass
    used = memory_allocated()
    return max(total - used, 0), total


def memory_allocated() -> int:
    """Bytes of tensors held by this process (resident set: the CPU has no allocator stats)."""
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:
        return 0


def synchronize() -> None:
    """CPU ops complete when they return."""


def mark_step() -> None:
    """Lazy-mode graph flush. Eager CPU execution has nothing to flush."""


class Graph:
    """Capture/replay of a callable with static input buffers (HPU graphs on Gaudi).

    The emulation replays by calling the function again on the captured input buffers, which is
    what a replay computes; callers must update the buffers in place, exactly as on Gaudi.
    """

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None
        self._args: tuple = ()
        self._kwargs: dict = {}
        self.output: Any = None

    def capture(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self.output = fn(*args, **kwargs)
        return self.output

    def replay(self) -> Any:
        if self._fn is None:
            raise RuntimeError("Graph.replay() called before capture()")
        self.output = self._fn(*self._args, **self._kwargs)
        return self.output


class Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass


class Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def stream(s: Stream | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- fused kernels
def fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    softmax_mode: str = "None",
    recompute_mode: bool | None = None,
    valid_sequence_lengths: torch.Tensor | None = None,
    padding_side: str = "left",
) -> torch.Tensor:
    """Gaudi FusedSDPA: [batch, heads, q_len, head_dim] layouts, optional boolean/additive mask.

    `is_causal` masks key j > query i (top-left aligned, as on Gaudi); `valid_sequence_lengths`
    (per batch row) masks padded key positions on `padding_side`. `softmax_mode` ("None" exact,
    "fast" lower precision on Gaudi) and `recompute_mode` are performance knobs with no effect on
    the emulated result. Grouped-query attention: key/value may have fewer heads than query when
    the query heads are a multiple.
    """
    if dropout_p != 0.0:
        raise ValueError("fused_sdpa: dropout is not used at inference time")
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = attn_mask
    if valid_sequence_lengths is not None:
        pos = torch.arange(kv_len, device=query.device)
        lens = valid_sequence_lengths.view(-1, 1)
        valid = pos >= kv_len - lens if padding_side == "left" else pos < lens
        valid = valid[:, None, None, :]
        mask = valid if mask is None else _combine(mask, valid)
    if is_causal:
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
        mask = causal if mask is None else _combine(mask, causal)
    enable_gqa = key.shape[-3] != query.shape[-3]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )


def _combine(mask: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))
