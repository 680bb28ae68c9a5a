"""Each op family's Gaudi path in CPU emulation, side by side with vLLM's native path on the CPU.

Same layer instance, same inputs: vLLM's forward_native (for MoE, vLLM's CPU fused-MoE kernel,
which is what vLLM's CPU platform runs for unquantized experts; for grouped top-k, vLLM's native
function without its torch.compile wrapper) against forward_oot on the emulated Gaudi kernels.
The two run alternately, and the table shows the median of the repeats and the ratio
emulated / native. Emulation should do no needless work: the target is a ratio <= 1.2 (rows
above it are flagged). Absolute times are machine noise; read the ratios.

Expected exception: MoE with few tokens per expert (the decode rows). Both sides compute each
routed (token, expert) pair once, but vLLM's side is a hand-written C++ kernel on prepacked
weights, which outruns torch's matmuls at a handful of rows; with prefill-sized batches the
emulation keeps up.

    python benchmarks/ops.py [--repeats N] [--tokens T]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

TARGET_RATIO = 1.2


@dataclass
class Case:
    op: str
    shape: str
    dtype: torch.dtype
    native: Callable[[], object]
    emulated: Callable[[], object]


def median_ms(native: Callable[[], object], emulated: Callable[[], object], repeats: int):
    for fn in (native, emulated, native, emulated):  # warm-up: allocator, lazy caches
        fn()
    times: dict[str, list[float]] = {"native": [], "emulated": []}
    for _ in range(repeats):
        for name, fn in (("native", native), ("emulated", emulated)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["native"]) * 1e3, statistics.median(times["emulated"]) * 1e3


def norm_cases(tokens: int) -> list[Case]:
    from vllm_gaudi_ops.families.norm import HpuGemmaRMSNorm, HpuRMSNorm

    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        x, residual = torch.randn(tokens, 4096, dtype=dtype), torch.randn(tokens, 4096, dtype=dtype)
        norm = HpuRMSNorm(4096, dtype=dtype)
        shape = f"{tokens}x4096"
        cases.append(
            Case("RMSNorm", shape, dtype, lambda n=norm, x=x: n.forward_native(x),
                 lambda n=norm, x=x: n.forward_oot(x))
        )  # fmt: skip
        cases.append(
            Case("RMSNorm + residual", shape, dtype,
                 lambda n=norm, x=x, r=residual: n.forward_native(x, r),
                 lambda n=norm, x=x, r=residual: n.forward_oot(x, r))
        )  # fmt: skip
    gemma = HpuGemmaRMSNorm(4096)
    gemma.weight.data = gemma.weight.data.bfloat16()
    x = torch.randn(tokens, 4096, dtype=torch.bfloat16)
    cases.append(
        Case("GemmaRMSNorm", f"{tokens}x4096", torch.bfloat16, lambda: gemma.forward_native(x),
             lambda: gemma.forward_oot(x))
    )  # fmt: skip
    return cases


def rotary_cases(tokens: int) -> list[Case]:
    from vllm_gaudi_ops.families import rotary

    heads, kv_heads, head = 32, 8, 128
    dtype = torch.bfloat16
    positions = torch.randint(0, 4096, (tokens,))
    query = torch.randn(tokens, heads * head, dtype=dtype)
    key = torch.randn(tokens, kv_heads * head, dtype=dtype)
    shape = f"{tokens}x({heads}+{kv_heads})x{head}"
    layers = {
        "RotaryEmbedding neox": rotary.HpuRotaryEmbedding(head, head, 4096, 1e4, True, dtype),
        "RotaryEmbedding gptj 1/2": rotary.HpuRotaryEmbedding(head, 64, 4096, 1e4, False, dtype),
        "Llama3RotaryEmbedding": rotary.HpuLlama3RotaryEmbedding(
            head, head, 4096, 5e5, True, dtype, 8.0, 1.0, 4.0, 8192
        ),
        "YaRNScalingRotaryEmbedding": rotary.HpuYaRNScalingRotaryEmbedding(
            head, head, 4096, 1e4, True, 4.0, dtype
        ),
    }
    cases = [
        Case(name, shape, dtype,
             lambda r=r: r.forward_native(positions, query, key),
             lambda r=r: r.forward_oot(positions, query, key))
        for name, r in layers.items()
    ]  # fmt: skip
    mrope = rotary.HpuMRotaryEmbedding(
        head, head, 4096, 1e6, True, dtype, mrope_section=[16, 24, 24], mrope_interleaved=False
    )
    positions_3d = torch.randint(0, 4096, (3, tokens))
    cases.append(
        Case("MRotaryEmbedding t/h/w", shape, dtype,
             lambda: mrope.forward_native(positions_3d, query, key),
             lambda: mrope.forward_oot(positions_3d, query, key))
    )  # fmt: skip
    deepseek = rotary.HpuDeepseekScalingRotaryEmbedding(64, 64, 4096, 1e4, False, 40.0, dtype)
    q_pe, k_pe = torch.randn(tokens, 16, 64, dtype=dtype), torch.randn(tokens, 1, 64, dtype=dtype)
    cases.append(
        Case("DeepseekScalingRotaryEmbedding", f"{tokens}x(16+1)x64", dtype,
             lambda: deepseek.forward_native(positions, q_pe, k_pe),
             lambda: deepseek.forward_oot(positions, q_pe, k_pe))
    )  # fmt: skip
    vision = rotary.HpuApplyRotaryEmb(is_neox_style=True)
    x = torch.randn(1024, 16, 80, dtype=dtype)
    angles = torch.rand(1024, 40)
    cases.append(
        Case("ApplyRotaryEmb (ViT)", "1024x16x80", dtype,
             lambda: vision.forward_native(x, angles.cos(), angles.sin()),
             lambda: vision.forward_oot(x, angles.cos(), angles.sin()))
    )  # fmt: skip
    return cases


def activation_cases(tokens: int) -> list[Case]:
    from vllm_gaudi_ops.families import activation

    dtype = torch.bfloat16
    x = torch.randn(tokens, 2 * 5632, dtype=dtype)
    layers = {
        "SiluAndMul": activation.HpuSiluAndMul(compile_native=False),
        "GeluAndMul tanh": activation.HpuGeluAndMul(approximate="tanh"),
        "SwigluOAIAndMul": activation.HpuSwigluOAIAndMul(),
    }
    return [
        Case(name, f"{tokens}x{2 * 5632}", dtype, lambda a=a: a.forward_native(x),
             lambda a=a: a.forward_oot(x))
        for name, a in layers.items()
    ]  # fmt: skip


def moe_cases(decode_tokens: int, prefill_tokens: int) -> list[Case]:
    # vLLM's CPU kernels (the reference): its own loader picks _C or _C_AVX2 for this CPU; a direct
    # `import vllm._C` aborts the process on AVX2-only machines.
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.router import grouped_topk_router

    from vllm_gaudi_ops.families.moe import HpuGroupedTopk, HpuUnquantizedFusedMoEMethod

    cases = []
    hidden, inter, experts, topk = 1024, 1024, 16, 2
    # Few tokens per expert (decode) and many (prefill), in Gaudi's dtype and in float32.
    for tokens, dtype in (
        (decode_tokens, torch.bfloat16),
        (decode_tokens, torch.float32),
        (prefill_tokens, torch.bfloat16),
    ):
        config = FusedMoEConfig(
            num_experts=experts, experts_per_token=topk, hidden_dim=hidden,
            intermediate_size=inter, num_local_experts=experts, num_logical_experts=experts,
            activation=MoEActivation.SILU, device="cpu",
            routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=dtype,
        )  # fmt: skip
        method = HpuUnquantizedFusedMoEMethod(config)
        layer = torch.nn.Module()  # the RoutedExperts attributes the method reads
        layer.custom_routing_function, layer.scoring_func = None, "softmax"
        layer.expert_map, layer.apply_router_weight_on_input = None, False
        method.create_weights(layer, experts, hidden, inter, dtype)
        layer.w13_weight.data.normal_(0, 0.05)
        layer.w2_weight.data.normal_(0, 0.05)
        method.process_weights_after_loading(layer)
        w13 = cpu_prepack_moe_weight(layer.w13_weight.data, "vec")
        w2 = cpu_prepack_moe_weight(layer.w2_weight.data, "vec")
        x = torch.randn(tokens, hidden, dtype=dtype)
        weights, ids = torch.randn(tokens, experts).softmax(-1).topk(topk, dim=-1)
        ids = ids.to(torch.int32)

        def native(x=x, w13=w13, w2=w2, weights=weights, ids=ids):
            out = torch.empty_like(x)
            cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, "silu", "vec")
            return out

        cases.append(
            Case(f"UnquantizedFusedMoEMethod E{experts} top{topk}", f"{tokens}x{hidden}x{inter}",
                 dtype, native,
                 lambda m=method, ly=layer, x=x, w=weights, i=ids: m.forward_oot(ly, x, w, i))
        )  # fmt: skip
    router = HpuGroupedTopk(8, True, num_expert_group=8, topk_group=4, scoring_func="sigmoid")
    logits, bias = torch.randn(prefill_tokens, 256), torch.randn(256) / 10
    hidden_states = torch.empty(prefill_tokens, 1)
    eager = grouped_topk_router.grouped_topk._torchdynamo_orig_callable
    cases.append(
        Case("GroupedTopk 256e/8g", f"{prefill_tokens}x256", torch.float32,
             lambda: eager(hidden_states, logits, 8, True, 8, 4, "sigmoid", 1.0, bias),
             lambda: router.forward_oot(hidden_states, logits, bias))
    )  # fmt: skip
    return cases


def encoder_attention_cases() -> list[Case]:
    from vllm_gaudi_ops.families.encoder_attention import HpuMMEncoderAttention

    dtype = torch.bfloat16
    attention = HpuMMEncoderAttention(16, 80)
    q, k, v = (torch.randn(1, 1024, 16 * 80, dtype=dtype) for _ in range(3))
    cu_seqlens = torch.tensor([0, 256, 512, 768, 1024], dtype=torch.int32)
    return [
        Case("MMEncoderAttention", "1x1024x16x80", dtype,
             lambda: attention.forward_native(q, k, v), lambda: attention.forward_oot(q, k, v)),
        Case("MMEncoderAttention 4 packed", "1x(4x256)x16x80", dtype,
             lambda: attention.forward_native(q, k, v, cu_seqlens),
             lambda: attention.forward_oot(q, k, v, cu_seqlens)),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a busy 2-core machine, OpenMP barriers between "
        "threads dominate small ops and turn timings into noise)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform

    from vllm_gaudi_platform.seam import backend

    # vLLM's side runs on the platform vLLM resolved (the CPU unless emulation was exported);
    # the ops' side calls the seam, switched to its emulated kernels here.
    os.environ["VLLM_HPU_EMULATION"] = "cpu"
    backend.cache_clear()
    print(
        f"vLLM platform: {type(current_platform).__name__}; kernels: {backend().NAME}; "
        f"torch threads: {torch.get_num_threads()}"
    )
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        cases = [
            *norm_cases(args.tokens),
            *rotary_cases(args.tokens),
            *activation_cases(args.tokens),
            *moe_cases(args.tokens // 4, args.tokens),
            *encoder_attention_cases(),
        ]
    header = (
        f"{'op':<38} {'shape':<22} {'dtype':<9} {'native ms':>10} {'emul. ms':>10} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    flagged = 0
    with torch.inference_mode():
        for case in cases:
            native, emulated = median_ms(case.native, case.emulated, args.repeats)
            ratio = emulated / native
            flag = " !" if ratio > TARGET_RATIO else ""
            flagged += bool(flag)
            dtype = str(case.dtype).removeprefix("torch.")
            print(
                f"{case.op:<38} {case.shape:<22} {dtype:<9} {native:>10.3f} {emulated:>10.3f} "
                f"{ratio:>6.2f}{flag}"
            )
    print(f"\nratio = emulated / native, median of {args.repeats}; target <= {TARGET_RATIO}")
    if flagged:
        print(f"{flagged} op(s) above the target (!)")


if __name__ == "__main__":
    main()
