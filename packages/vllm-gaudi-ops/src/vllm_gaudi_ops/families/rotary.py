"""RotaryEmbedding and its variants on Gaudi's rotary kernel.

vLLM looks replacements up by class name, so every variant has its own subclass here that
inherits from that variant (keeping its cos/sin cache construction) and overrides forward_oot.
The variants differ only in which cos/sin each token gets; the rotation is always the kernel:
BLOCKWISE for GPT-NeoX style, PAIRWISE for GPT-J style, on the first rotary_dim dims of each
head (DeepSeek V4: the last ones), with cos/sin widened to the full rotary width as the kernel
expects.

Left to vLLM: DualChunkRotaryEmbedding (it builds five differently-rotated query copies for
dual-chunk attention, which only vLLM's CUDA flash-attention backend implements) and
Phi3LongRoPEScaledRotaryEmbedding (a plain nn.Module in vLLM 0.32, not a CustomOp, so it cannot
be replaced; its torch code runs on Gaudi as it is).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.rotary_embedding import (
    BailingMRotaryEmbedding,
    DeepseekScalingRotaryEmbedding,
    DeepseekV4ScalingRotaryEmbedding,
    DynamicNTKAlphaRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    FourierRotaryEmbedding,
    Gemma4RotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    Llama4VisionRotaryEmbedding,
    MRotaryEmbedding,
    MRotaryEmbeddingInterleaved,
    NTKScalingRotaryEmbedding,
    RotaryEmbedding,
    YaRNScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb
from vllm.model_executor.layers.rotary_embedding.ernie45_vl_rope import (
    Ernie4_5_VLRotaryEmbedding,
)

from vllm_gaudi_ops import stats
from vllm_gaudi_platform.seam import backend

FAMILY = "rotary"


def _mode(is_neox_style: bool) -> int:
    kernels = backend()
    return kernels.ROPE_BLOCKWISE if is_neox_style else kernels.ROPE_PAIRWISE


def _full_width(
    cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Widen vLLM's half-width cos/sin ([..., rot/2]) to the kernel's full width ([..., rot])."""
    if is_neox_style:
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: int, rotary_dim: int
) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of x's last dim; the rest passes through."""
    kernels = backend()
    if rotary_dim == x.shape[-1]:
        return kernels.apply_rotary_pos_emb(x, cos, sin, None, 0, mode)
    rotated = kernels.apply_rotary_pos_emb(x[..., :rotary_dim], cos, sin, None, 0, mode)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class _KernelRope:
    """The rotation every RotaryEmbeddingBase variant shares, given its cos/sin per token."""

    head_size: int
    rotary_dim: int
    is_neox_style: bool

    def _rotate_qk(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """query/key: [num_tokens, heads * head_size] (any shape with that many elements);
        cos/sin: vLLM's half width, [num_tokens, rotary_dim / 2]."""
        cos, sin = _full_width(cos, sin, self.is_neox_style)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        mode = _mode(self.is_neox_style)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            heads = x.view(num_tokens, -1, self.head_size)
            return _rotate(heads, cos, sin, mode, self.rotary_dim).reshape(x.shape)

        return rotate(query), None if key is None else rotate(key)


class _CachedRope(_KernelRope):
    """Variants that differ from RotaryEmbedding only in how their cos/sin cache is built."""

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats.count(FAMILY)
        cache = self._match_cos_sin_cache_dtype(query)  # type: ignore[attr-defined]
        positions = positions.flatten()
        cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
        return self._rotate_qk(query, key, cos, sin, positions.shape[0])


class HpuRotaryEmbedding(_CachedRope, RotaryEmbedding):
    pass


class HpuLlama3RotaryEmbedding(_CachedRope, Llama3RotaryEmbedding):
    pass


class HpuLinearScalingRotaryEmbedding(_CachedRope, LinearScalingRotaryEmbedding):
    pass


class HpuNTKScalingRotaryEmbedding(_CachedRope, NTKScalingRotaryEmbedding):
    pass


class HpuDynamicNTKScalingRotaryEmbedding(_CachedRope, DynamicNTKScalingRotaryEmbedding):
    pass


class HpuDynamicNTKAlphaRotaryEmbedding(_CachedRope, DynamicNTKAlphaRotaryEmbedding):
    pass


class HpuYaRNScalingRotaryEmbedding(_CachedRope, YaRNScalingRotaryEmbedding):
    pass


class HpuGemma4RotaryEmbedding(_CachedRope, Gemma4RotaryEmbedding):
    pass


def _deepseek_cos_sin(
    layer: DeepseekScalingRotaryEmbedding, positions: torch.Tensor, offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if offsets is not None:
        positions = positions + offsets
    cos, sin = layer.cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = _full_width(cos, sin, layer.is_neox_style)
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


class HpuDeepseekScalingRotaryEmbedding(_KernelRope, DeepseekScalingRotaryEmbedding):
    """YaRN for DeepSeek MLA: query/key come as [tokens, heads, head_size], with offsets."""

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats.count(FAMILY)
        if key is None:
            raise ValueError("DeepseekScalingRotaryEmbedding needs the key")
        cos, sin = _deepseek_cos_sin(self, positions, offsets)
        mode = _mode(self.is_neox_style)
        return (
            _rotate(query, cos, sin, mode, self.rotary_dim),
            _rotate(key, cos, sin, mode, self.rotary_dim),
        )


class HpuDeepseekV4ScalingRotaryEmbedding(_KernelRope, DeepseekV4ScalingRotaryEmbedding):
    """DeepSeek V4: rotates the LAST rotary_dim dims with a float32 cache; `inverse` undoes it."""

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        inverse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats.count(FAMILY)
        cos, sin = _deepseek_cos_sin(self, positions, offsets)
        if inverse:
            sin = -sin  # rotating by -angle
        mode = _mode(self.is_neox_style)
        kernels = backend()

        def rotate_tail(x: torch.Tensor) -> torch.Tensor:
            # The float32 cache makes the kernel compute (and return) float32, as vLLM does.
            tail = x[..., -self.rotary_dim :]
            rotated = kernels.apply_rotary_pos_emb(tail, cos, sin, None, 0, mode).to(x.dtype)
            if self.rotary_dim == x.shape[-1]:
                return rotated
            return torch.cat((x[..., : -self.rotary_dim], rotated), dim=-1)

        return rotate_tail(query), None if key is None else rotate_tail(key)


def _axis_gather(
    cos: torch.Tensor, sin: torch.Tensor, axis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick, per rotary channel, the t/h/w position axis it uses: [axes, T, C] -> [T, C]."""
    index = axis.view(1, 1, -1).expand(1, cos.shape[1], -1)
    return cos.gather(0, index)[0], sin.gather(0, index)[0]


class _MRopeAxes:
    """Multimodal RoPE: with [3, T] positions each rotary channel follows one of t/h/w."""

    def _channel_axes(self, num_channels: int, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def _axes(self, num_channels: int, device: torch.device) -> torch.Tensor:
        axis = self.__dict__.get("_hpu_channel_axes")
        if axis is None or axis.device != device or axis.numel() != num_channels:
            axis = self._channel_axes(num_channels, device)
            self.__dict__["_hpu_channel_axes"] = axis
        return axis


class HpuMRotaryEmbedding(_MRopeAxes, _KernelRope, MRotaryEmbedding):
    """MRoPE (Qwen2-VL family): contiguous t/h/w sections, or interleaved t,h,w,t,h,w..."""

    mrope_section: list[int] | None
    mrope_interleaved: bool

    def _channel_axes(self, num_channels: int, device: torch.device) -> torch.Tensor:
        assert self.mrope_section, "2-D MRoPE positions need mrope_section"
        # Built from Python ints: a constant under torch.compile (a repeat_interleave by a
        # tensor of counts has a data-dependent shape and breaks the graph).
        sections = [int(n) for n in self.mrope_section]
        if not self.mrope_interleaved:
            axes = [axis for axis, count in enumerate(sections) for _ in range(count)]
        else:
            axes = [
                1
                if c % 3 == 1 and c < sections[1] * 3
                else 2
                if c % 3 == 2 and c < sections[2] * 3
                else 0
                for c in range(num_channels)
            ]
        return torch.tensor(axes, dtype=torch.int64, device=device)

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # `offsets` is accepted and ignored, exactly as vLLM's MRotaryEmbedding does.
        stats.count(FAMILY)
        if key is None:
            raise ValueError("MRotaryEmbedding needs the key")
        cache = self._match_cos_sin_cache_dtype(query)
        cos, sin = cache[positions].chunk(2, dim=-1)
        if positions.ndim == 2:
            cos, sin = _axis_gather(cos, sin, self._axes(cos.shape[-1], cos.device))
        return self._rotate_qk(query, key, cos, sin, positions.shape[-1])


class HpuMRotaryEmbeddingInterleaved(_KernelRope, MRotaryEmbeddingInterleaved):
    """vLLM's class overrides forward() itself (no CustomOp dispatch), so this one does too."""

    def forward(  # type: ignore[override]
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.forward_oot(positions, query, key)

    def forward_oot(  # type: ignore[override]
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats.count(FAMILY)
        cos_sin, token_index = self._rebuild_pos_emb(positions)
        cos, sin = cos_sin.to(query.dtype).chunk(2, dim=-1)
        return self._rotate_qk(query, key, cos, sin, token_index.shape[0])


class HpuErnie4_5_VLRotaryEmbedding(_MRopeAxes, _KernelRope, Ernie4_5_VLRotaryEmbedding):
    """Ernie 4.5 VL: h,w alternate over the first h + w channels, t takes the rest."""

    mrope_section: list[int] | None

    def _channel_axes(self, num_channels: int, device: torch.device) -> torch.Tensor:
        assert self.mrope_section, "2-D positions need mrope_section"
        height, width, _ = self.mrope_section
        assert height == width, "Ernie 4.5 VL RoPE needs equal h and w sections"
        channel = torch.arange(num_channels, device=device)
        return torch.where(channel < height + width, 1 + channel % 2, 0)

    def forward_oot(  # type: ignore[override]
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats.count(FAMILY)
        if key is None:
            raise ValueError("Ernie4_5_VLRotaryEmbedding needs the key")
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)
        if positions.ndim == 2:
            cos, sin = _axis_gather(cos, sin, self._axes(cos.shape[-1], cos.device))
        return self._rotate_qk(query, key, cos, sin, positions.shape[-1])


class HpuBailingMRotaryEmbedding(_KernelRope, BailingMRotaryEmbedding):
    """Bailing M-RoPE: vLLM's own cos/sin selection, then the kernel."""

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats.count(FAMILY)
        if key is None:
            raise ValueError("Bailing M-RoPE requires key states")
        cos, sin = self.select_cos_sin(positions, self._match_cos_sin_cache_dtype(query))
        return self._rotate_qk(query, key, cos, sin, positions.shape[-1])


class HpuFourierRotaryEmbedding(_KernelRope, FourierRotaryEmbedding):
    """FoPE: full-width, GPT-NeoX-style cos/sin, optionally one per KV head."""

    update_cache: bool  # set by vLLM's class: the cache is rebuilt once coefficients load

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats.count(FAMILY)
        if key is None:
            raise ValueError("FourierRotaryEmbedding needs the key")
        if self.update_cache:
            # The Fourier coefficients are loaded after __init__: build the cache on first use.
            self.cos_sin_cache.copy_(self._compute_cos_sin_cache().to(self.dtype))
            self.update_cache = False
        positions = positions.flatten()
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        query = query.unflatten(-1, (-1, self.head_size))
        key = key.unflatten(-1, (-1, self.head_size))
        query_shape, key_shape = query.shape, key.shape
        if cos.dim() == 3:
            # One cos/sin per (token, KV head): the heads of a KV group share it.
            cos, sin = cos.flatten(0, 1), sin.flatten(0, 1)
            query = query.reshape(cos.shape[0], -1, self.head_size)
            key = key.reshape(cos.shape[0], -1, self.head_size)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        kernels = backend()
        mode = kernels.ROPE_BLOCKWISE
        query = kernels.apply_rotary_pos_emb(query, cos, sin, None, 0, mode)
        key = kernels.apply_rotary_pos_emb(key, cos, sin, None, 0, mode)
        return query.view(query_shape), key.view(key_shape)


class HpuLlama4VisionRotaryEmbedding(_KernelRope, Llama4VisionRotaryEmbedding):
    """Llama 4 vision: a complex cache multiplies adjacent pairs, i.e. PAIRWISE rotation."""

    def forward_oot(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats.count(FAMILY)
        if key is None:
            raise ValueError("Llama4VisionRotaryEmbedding needs the key")
        cache = self.cos_sin_cache.to(query.device)
        # query: [batch, patches, heads, head_size]; one angle per patch and channel pair.
        shape = [1] * query.dim()
        shape[1], shape[-1] = query.shape[1], query.shape[-1] // 2
        cos, sin = _full_width(cache.real.reshape(shape), cache.imag.reshape(shape), False)
        kernels = backend()
        mode = kernels.ROPE_PAIRWISE
        query_out = kernels.apply_rotary_pos_emb(query.float(), cos, sin, None, 0, mode)
        key_out = kernels.apply_rotary_pos_emb(key.float(), cos, sin, None, 0, mode)
        return query_out.type_as(query), key_out.type_as(key)


class HpuApplyRotaryEmb(ApplyRotaryEmb):
    """The rotation vision encoders call with their own cos/sin ([seq, head_size / 2])."""

    def forward_oot(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        dtype = torch.float32 if self.enable_fp32_compute else x.dtype
        cos, sin = _full_width(cos.to(dtype), sin.to(dtype), self.is_neox_style)
        out = backend().apply_rotary_pos_emb(
            x.to(dtype), cos.unsqueeze(-2), sin.unsqueeze(-2), None, 0, _mode(self.is_neox_style)
        )
        return out.to(x.dtype)


REPLACEMENTS: tuple[tuple[type, type], ...] = (
    (RotaryEmbedding, HpuRotaryEmbedding),
    (Llama3RotaryEmbedding, HpuLlama3RotaryEmbedding),
    (LinearScalingRotaryEmbedding, HpuLinearScalingRotaryEmbedding),
    (NTKScalingRotaryEmbedding, HpuNTKScalingRotaryEmbedding),
    (DynamicNTKScalingRotaryEmbedding, HpuDynamicNTKScalingRotaryEmbedding),
    (DynamicNTKAlphaRotaryEmbedding, HpuDynamicNTKAlphaRotaryEmbedding),
    (YaRNScalingRotaryEmbedding, HpuYaRNScalingRotaryEmbedding),
    (Gemma4RotaryEmbedding, HpuGemma4RotaryEmbedding),
    (DeepseekScalingRotaryEmbedding, HpuDeepseekScalingRotaryEmbedding),
    (DeepseekV4ScalingRotaryEmbedding, HpuDeepseekV4ScalingRotaryEmbedding),
    (MRotaryEmbedding, HpuMRotaryEmbedding),
    (MRotaryEmbeddingInterleaved, HpuMRotaryEmbeddingInterleaved),
    (Ernie4_5_VLRotaryEmbedding, HpuErnie4_5_VLRotaryEmbedding),
    (BailingMRotaryEmbedding, HpuBailingMRotaryEmbedding),
    (FourierRotaryEmbedding, HpuFourierRotaryEmbedding),
    (Llama4VisionRotaryEmbedding, HpuLlama4VisionRotaryEmbedding),
    (ApplyRotaryEmb, HpuApplyRotaryEmb),
)
