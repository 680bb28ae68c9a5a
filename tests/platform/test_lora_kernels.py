"""The seam's batched LoRA kernels and the HPU punica wrapper, against a naive float64 reference
that loops over tokens and picks each token's adapter. The kernels and the wrapper's products run
on both backends of the seam (`hpu_backend`: the emulation, and seam/gaudi over the Habana stand-in
off Gaudi; the wrapper resolves the seam's backend); the wrapper's bookkeeping tests take the
`emulated` fixture."""

from __future__ import annotations

import pytest
import torch
from vllm.lora.layers import LoRAMapping

from vllm_gaudi_platform.worker.lora import PunicaWrapperHPU, unwarmed_shapes, warmup_mapping

SLOTS, RANK, IN, OUT = 3, 8, 48, 40
# Token slots mixing every adapter, runs of the same one, and no adapter (-1).
TOKEN_SLOTS = [0, 0, 2, -1, 1, 1, 1, -1, 2, 0, -1]


def _reference_shrink(x, lora_a, slots, scale):
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] = scale * x[t].double() @ lora_a[s].double().T
    return out


def _reference_expand(x, lora_b, slots):
    out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] = x[t].double() @ lora_b[s].double().T
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_shrink_applies_each_tokens_own_adapter(hpu_backend, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(TOKEN_SLOTS), IN, generator=g).to(dtype)
    lora_a = torch.randn(SLOTS, RANK, IN, generator=g).to(dtype)
    slots = torch.tensor(TOKEN_SLOTS)
    out = hpu_backend.lora_shrink(x, lora_a, slots, 0.5)
    assert out.dtype == torch.float32 and out.shape == (len(TOKEN_SLOTS), RANK)
    torch.testing.assert_close(
        out.double(), _reference_shrink(x, lora_a, TOKEN_SLOTS, 0.5), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_expand_applies_each_tokens_own_adapter(hpu_backend, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(TOKEN_SLOTS), RANK, generator=g)
    lora_b = torch.randn(SLOTS, OUT, RANK, generator=g).to(dtype)
    slots = torch.tensor(TOKEN_SLOTS)
    out = hpu_backend.lora_expand(x, lora_b, slots)
    assert out.dtype == torch.float32 and out.shape == (len(TOKEN_SLOTS), OUT)
    torch.testing.assert_close(
        out.double(), _reference_expand(x, lora_b, TOKEN_SLOTS), rtol=1e-5, atol=1e-4
    )


def test_lora_kernels_leave_tokens_without_adapter_at_zero(hpu_backend):
    x = torch.randn(4, IN)
    lora_a = torch.randn(SLOTS, RANK, IN)
    lora_b = torch.randn(SLOTS, OUT, RANK)
    none = torch.full((4,), -1)
    assert not hpu_backend.lora_shrink(x, lora_a, none, 1.0).any()
    assert not hpu_backend.lora_expand(torch.randn(4, RANK), lora_b, none).any()


def _wrapper(slot_ids: list[int], num_padded: int) -> PunicaWrapperHPU:
    """A wrapper whose step has one request per token with adapter ids 10/20/30 in slots 0/1/2,
    plus `num_padded` padding tokens."""
    wrapper = PunicaWrapperHPU(max_num_batched_tokens=32, max_batches=4, device="cpu")
    index_to_id: list[int | None] = [10, 20, 30]
    ids = tuple(0 if s < 0 else index_to_id[s] for s in slot_ids)  # type: ignore[misc]
    wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=True), index_to_id, SLOTS + 1, 512)
    return wrapper


def test_punica_wrapper_adds_scaled_lora_per_slice_and_leaves_padding_alone(hpu_backend):
    g = torch.Generator().manual_seed(2)
    slices = (OUT, 24)  # two stacked output slices, like a fused q/v projection
    n, pad = len(TOKEN_SLOTS), 5
    wrapper = _wrapper(TOKEN_SLOTS, pad)
    x = torch.randn(n + pad, IN, generator=g)
    y = torch.randn(n + pad, sum(slices), generator=g)
    lora_a = tuple(torch.randn(SLOTS, 1, RANK, IN, generator=g) for _ in slices)
    lora_b = tuple(torch.randn(SLOTS, 1, w, RANK, generator=g) for w in slices)
    expected = y.double().clone()
    offset = 0
    slots = TOKEN_SLOTS + [-1] * pad
    for a, b, w in zip(lora_a, lora_b, slices):
        shrunk = _reference_shrink(x, a[:, 0], slots, 0.25)
        expected[:, offset : offset + w] += _reference_expand(shrunk, b[:, 0], slots)
        offset += w
    y_before = y.clone()
    wrapper.add_lora_linear(y, x, lora_a, lora_b, 0.25, slices)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[n:], y_before[n:]), "padding tokens must not get any adapter"


def test_punica_wrapper_resets_padding_left_by_a_longer_previous_step(emulated):
    wrapper = _wrapper([0, 1, 2, 0, 1, 2], 0)
    wrapper = _reuse(wrapper, [1, 2])
    assert wrapper._token_lora_indices[:6].tolist() == [1, 2, -1, -1, -1, -1]
    assert wrapper._embeddings_indices[2:6].tolist() == [0, 0, 0, 0]


def _reuse(wrapper: PunicaWrapperHPU, slot_ids: list[int]) -> PunicaWrapperHPU:
    index_to_id: list[int | None] = [10, 20, 30]
    ids = tuple(index_to_id[s] for s in slot_ids)  # type: ignore[misc]
    wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=True), index_to_id, SLOTS + 1, 512)
    return wrapper


def test_punica_wrapper_split_shrink_and_expand_equal_the_fused_linear(hpu_backend):
    g = torch.Generator().manual_seed(3)
    wrapper = _wrapper(TOKEN_SLOTS, 0)
    n = len(TOKEN_SLOTS)
    x = torch.randn(n, IN, generator=g)
    lora_a = (torch.randn(SLOTS, 1, RANK, IN, generator=g),)
    lora_b = (torch.randn(SLOTS, 1, OUT, RANK, generator=g),)
    fused = torch.zeros(n, OUT)
    wrapper.add_lora_linear(fused, x, lora_a, lora_b, 1.0, (OUT,))
    buffer = torch.zeros(1, n, RANK)
    wrapper.add_shrink(buffer, x, lora_a, 1.0)
    split = torch.zeros(n, OUT)
    wrapper.add_expand(split, buffer, lora_b, (OUT,), add_inputs=True)
    torch.testing.assert_close(split, fused)


def test_punica_wrapper_refuses_a_step_longer_than_its_buffers(emulated):
    wrapper = PunicaWrapperHPU(max_num_batched_tokens=4, max_batches=2, device="cpu")
    ids = (0,) * 7
    with pytest.raises(ValueError, match="max_num_batched_tokens \\+ max_num_seqs"):
        wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=True), [None, None], 3, 512)


def test_warmup_mapping_mixes_every_adapter_and_the_base_model():
    per_request, per_token, requests = warmup_mapping([3, 1, 1, 2], max_loras=2)
    assert per_request == (0, 1, 2, 0)
    assert per_token == (0, 0, 0, 1, 2, 0, 0)
    assert sorted(r.lora_int_id for r in requests) == [1, 2]


def test_punica_wrapper_refuses_mixture_of_experts_lora_by_name(emulated):
    wrapper = PunicaWrapperHPU(max_num_batched_tokens=4, max_batches=2, device="cpu")
    with pytest.raises(NotImplementedError, match=r"mixture-of-experts.*--enable-lora"):
        wrapper.add_lora_w13(torch.zeros(1), torch.zeros(1))


def test_unwarmed_lora_shapes_ignore_the_token_count_and_report_a_new_width(hpu_backend):
    wrapper = _wrapper(TOKEN_SLOTS, 0)
    x = torch.randn(len(TOKEN_SLOTS), IN)
    lora_a = (torch.randn(SLOTS, 1, RANK, IN),)
    lora_b = (torch.randn(SLOTS, 1, OUT, RANK),)
    wrapper.add_lora_linear(torch.zeros(len(TOKEN_SLOTS), OUT), x, lora_a, lora_b, 1.0, (OUT,))
    warmed = set(wrapper.shapes)
    wrapper.add_lora_linear(torch.zeros(3, OUT), x[:3], lora_a, lora_b, 1.0, (OUT,))
    assert unwarmed_shapes(wrapper, warmed) == []
    narrow_a = (torch.randn(SLOTS, 1, RANK // 2, IN),)
    narrow_b = (torch.randn(SLOTS, 1, OUT, RANK // 2),)
    wrapper.add_lora_linear(torch.zeros(3, OUT), x[:3], narrow_a, narrow_b, 1.0, (OUT,))
    assert unwarmed_shapes(wrapper, warmed) == [
        ("expand", RANK // 2, SLOTS, RANK // 2, OUT),
        ("shrink", IN, SLOTS, RANK // 2, RANK // 2),
    ]
