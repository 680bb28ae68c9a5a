"""The roofline model of `benchmarks/gaudi_roofline.py` (`benchmarks/_roofline_model.py`) prices
a step the way its docstring says: a decode step at batch 1 streams the weights once and is bound
by HBM bandwidth, a few more sequences add almost nothing, an exact-fit bucket loses nothing to
padding, and the routed-expert gather hands the MoE kernel top_k of num_experts experts at batch
1. It also names only calls the seam's contract has. A model, checked against arithmetic done
here from the published figures, not against a Gaudi.
"""

from __future__ import annotations

import pytest

from benchmarks import _roofline_model as rm
from benchmarks import gaudi_roofline
from benchmarks.bucketing import Step
from vllm_gaudi_platform.bucketing import Bucket
from vllm_gaudi_platform.seam import contract


def _llama_weights_read_at_decode() -> float:
    """Bytes of Llama-3.1-8B weights a bf16 decode step reads, from the config: every layer's
    q/k/v/o and MLP matrices and the untied lm_head. The embedding table (0.5 B parameters of
    the 8.0 B) is not streamed: a step looks up one row per token, so this is ~15.0 GB, not the
    16 GB of the whole checkpoint."""
    hd, inter, vocab = 4096, 14336, 128256
    attn = hd * (32 + 2 * 8) * 128 + 32 * 128 * hd
    mlp = 3 * hd * inter
    return 2.0 * (32 * (attn + mlp) + vocab * hd)


def test_decode_at_batch_1_streams_the_weights_once_at_hbm_bandwidth():
    shape = rm.Shape("decode", 1, 1, 1)
    seconds = rm.step_seconds(rm.LLAMA_8B, rm.BF16, shape, rm.GAUDI2)
    expected = _llama_weights_read_at_decode() / 2.46e12
    assert expected == pytest.approx(6.1e-3, rel=0.01)
    assert seconds == pytest.approx(expected, rel=0.03)
    assert rm.hbm_bound_share(rm.LLAMA_8B, rm.BF16, shape, rm.GAUDI2) == 1.0
    # FP8 weights: about half the bytes, so about half the time.
    fp8 = rm.step_seconds(rm.LLAMA_8B, rm.FP8, shape, rm.GAUDI2)
    assert 0.5 < fp8 / seconds < 0.65


@pytest.mark.parametrize("model", rm.MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("device", rm.DEVICES, ids=lambda d: d.name)
def test_doubling_a_small_decode_batch_barely_changes_the_step(model, device):
    # Dense batches only: Mixtral's batch-1 step gathers its routed experts (see below).
    base = rm.Options(moe_gather=False)
    # Each sequence holds one block: the step's KV reads stay tiny next to the weights.
    for batch in (1, 2, 4):
        small = rm.step_seconds(model, rm.BF16, rm.Shape("decode", batch, 1, batch), device, base)
        large = rm.step_seconds(
            model, rm.BF16, rm.Shape("decode", 2 * batch, 1, 2 * batch), device, base
        )
        assert 1.0 < large / small < 1.02


def test_large_prefill_is_bound_by_the_mme_not_hbm():
    shape = rm.Shape("prompt", 1, 4096, 0)
    assert rm.hbm_bound_share(rm.LLAMA_8B, rm.BF16, shape, rm.GAUDI2) < 0.2


def test_an_exact_fit_bucket_loses_nothing_to_padding_and_a_larger_one_does():
    for step, bucket in (
        (Step("decode", 32, 1, 512, 32), Bucket("decode", 32, 1, 512)),
        (Step("prompt", 2, 512, 4, 1024), Bucket("prompt", 2, 512, 4)),
        (Step("prompt", 1, 2048, 0, 2048), Bucket("prompt", 1, 2048, 0)),
    ):
        real = gaudi_roofline.step_shape(step)
        padded = gaudi_roofline.bucket_shape(bucket)
        for model in rm.MODELS:
            t_real = rm.step_seconds(model, rm.BF16, real, rm.GAUDI3)
            t_pad = rm.step_seconds(model, rm.BF16, padded, rm.GAUDI3)
            assert t_pad == pytest.approx(t_real, rel=1e-12)
    real = gaudi_roofline.step_shape(Step("prompt", 2, 512, 4, 700))  # rows of 512 and 188
    padded = gaudi_roofline.bucket_shape(Bucket("prompt", 2, 512, 4))
    t_real = rm.step_seconds(rm.LLAMA_8B, rm.BF16, real, rm.GAUDI3)
    assert rm.step_seconds(rm.LLAMA_8B, rm.BF16, padded, rm.GAUDI3) > 1.2 * t_real


def test_moe_gather_at_batch_1_hands_the_kernel_top_k_of_the_experts():
    m = rm.MIXTRAL
    shape = rm.Shape("decode", 1, 1, 16)
    for prec in (rm.BF16, rm.FP8, rm.FP8_W8A16_MOE):
        gathered = gaudi_roofline.kernel_experts(prec, shape, rm.Options())
        dense = gaudi_roofline.kernel_experts(prec, shape, rm.Options(moe_gather=False))
        assert dense == pytest.approx(m.experts)
        assert gathered == pytest.approx(m.top_k)
        assert gathered / dense == pytest.approx(m.top_k / m.experts)  # 2 of 8
    # The gather's copy (read + write of the chosen experts) is priced too: at batch 1 the
    # bf16 expert traffic is 3 x 2 of 8 experts' bytes, not 2 of 8.
    calls = rm.step_calls(m, rm.BF16, shape, rm.Options())
    copy = next(c for c in calls if c.name.startswith("~gather routed experts"))
    assert copy.bytes == 2 * m.top_k * 3 * m.hidden * m.intermediate * 2
    # At 32 tokens (64 slots for 8 experts) nothing is gathered.
    wide = rm.Shape("decode", 32, 1, 512)
    assert gaudi_roofline.kernel_experts(rm.BF16, wide, rm.Options()) == pytest.approx(m.experts)


def test_w8a16_experts_move_more_bytes_than_w8a8():
    shape = rm.Shape("decode", 64, 1, 1024)
    w8a8 = rm.step_bytes(rm.MIXTRAL, rm.FP8, shape)
    w8a16 = rm.step_bytes(rm.MIXTRAL, rm.FP8_W8A16_MOE, shape)
    # Per expert weight: 1 byte read (W8A8) against 1 read + 2 written + 2 read (W8A16); W8A8
    # alone casts the layer's 64 hidden rows to FP8 (2 bytes read, 1 written per element).
    expert_bytes = rm.MIXTRAL.layers * rm.MIXTRAL.experts * 3 * 4096 * 14336
    cast_bytes = rm.MIXTRAL.layers * 3 * 64 * 4096
    assert w8a16 - w8a8 == pytest.approx(4 * expert_bytes - cast_bytes, rel=1e-12)


def test_masks_per_step_take_the_per_layer_builds_off_prompts_with_context():
    prompt = rm.Shape("prompt", 1, 2048, 8)
    decode = rm.Shape("decode", 8, 1, 64)
    per_layer = rm.Options(masks_per_step=False)
    for shape, saves in ((prompt, True), (decode, False)):
        now = rm.step_bytes(rm.LLAMA_8B, rm.BF16, shape)
        before = rm.step_bytes(rm.LLAMA_8B, rm.BF16, shape, per_layer)
        assert (before > now) is saves
    # One bool byte per mask element, built in 31 more layers. Two query slices of 1024
    # (VLLM_PREFILL_QUERY_SLICE's default), each against the context and the new keys up to
    # its own end.
    elems = 1024 * (8 * 128 + 1024) + 1024 * (8 * 128 + 2048)
    saved = rm.step_bytes(rm.LLAMA_8B, rm.BF16, prompt, per_layer) - rm.step_bytes(
        rm.LLAMA_8B, rm.BF16, prompt
    )
    assert saved == pytest.approx(31 * elems)


def test_every_call_the_model_names_is_in_the_seam_contract():
    contract_names = {n for n in vars(contract.HpuBackend) if not n.startswith("_")}
    assert set(rm.MODELED) <= contract_names
    assert set(rm.MODELED) | set(rm.RUNTIME) | set(rm.NOT_MODELED) == contract_names
    shapes = (rm.Shape("decode", 4, 1, 8), rm.Shape("prompt", 2, 512, 4))
    for model in rm.MODELS:
        for prec in (rm.BF16, rm.FP8, rm.FP8_W8A16_MOE):
            for shape in shapes:
                for call in rm.step_calls(model, prec, shape):
                    assert call.name.startswith("~") or call.name in contract_names
