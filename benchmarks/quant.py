"""Each quantization method's linear in CPU emulation, side by side with the bf16 linear.

Per method, on the linears of one decoder layer of a 7B-class model (q/k/v/o, gate/up/down):
- weight bytes: everything the quantized layers keep (weights, scales, zero points) over the
  bf16 weights. Targets: <= 0.55x for FP8, <= 0.30x for 4-bit (rows above are flagged);
- time: the emulated quantized forward over the bf16 `F.linear`, same inputs, run alternately,
  median of the repeats, at a decode-sized and a prefill-sized batch. Emulation dequantizes or
  upcasts in plain torch, so ratios above 1 are expected here; on a Gaudi the FP8 GEMM runs
  natively. Absolute times are machine noise; read the ratios;
- error: the output's relative norm error against the bf16 linear on the original weights.

And for FP8 mixture of experts (`--moe`, a Mixtral-shaped layer scaled down: 8 experts, top-2):
the bytes of expert weights and scales the MoE method hands the seam's MoE kernel per forward,
over the bf16 experts' bytes, recorded at the kernel call: W8A8 on the FP8 kernel (per-tensor
static scales) against W8A16 (block-scaled experts, dequantized per call).

Adding a method: write `build_<method>(weight) -> Built` (weight is a bf16 [N, K] torch Linear
weight) and add it to METHODS with its byte target.

    python benchmarks/quant.py [--repeats N] [--tokens T ...] [--methods NAME ...] [--moe]

Accuracy of whole quantized checkpoints (held-out perplexity of the trained tiny Llama, quantized
over float, per format): benchmarks/quant_perplexity.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gaudi_testkit.parallel import single_process_parallel

# One decoder layer of a Llama-2-7B-like model: (name, out_features N, in_features K).
LAYER = (
    ("q_proj", 4096, 4096),
    ("k_proj", 4096, 4096),
    ("v_proj", 4096, 4096),
    ("o_proj", 4096, 4096),
    ("gate_proj", 11008, 4096),
    ("up_proj", 11008, 4096),
    ("down_proj", 4096, 11008),
)
# The linear timed (the largest shape the MLP runs).
TIMED = ("up_proj", 11008, 4096)


@dataclass
class Built:
    """A quantized linear: its forward (x [T, K] bf16 -> [T, N] bf16) and every tensor it keeps."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


# ----------------------------------------------------------------------------- FP8 builders
def _fp8_from_checkpoint(weight: torch.Tensor, scheme: str, static: bool) -> Built:
    """Quantize like an FP8 checkpoint would be, then process it as HpuFp8LinearMethod does."""
    from vllm_gaudi_quant.methods.fp8 import (
        CHECKPOINT_FP8_MAX,
        FP8_DTYPE,
        apply_fp8_linear,
        dequantize_blocks,
        quantize_per_channel,
    )

    w = weight.float()
    if scheme == "tensor":
        scale = w.abs().max() / CHECKPOINT_FP8_MAX
        wq = (w / scale).to(FP8_DTYPE).t().contiguous()
        # The loader keeps one scale per output row whatever the checkpoint's granularity.
        w_scale = scale.expand(w.shape[0]).contiguous()
    elif scheme == "channel":
        wq8, w_scale = quantize_per_channel(w)
        wq = wq8.t().contiguous()
    else:  # block [128, 128] checkpoints, requantized per channel at load
        n, k = w.shape
        tiles = w.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3))
        scale_inv = tiles / CHECKPOINT_FP8_MAX
        full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
        wq8, w_scale = quantize_per_channel(
            dequantize_blocks((w / full).to(FP8_DTYPE), scale_inv, (128, 128))
        )
        wq = wq8.t().contiguous()
    input_scale = torch.tensor(8.0 / CHECKPOINT_FP8_MAX) if static else None
    kept = [wq, w_scale] + ([input_scale] if static else [])
    return Built(lambda x: apply_fp8_linear(x, wq, w_scale, input_scale), kept)


def build_fp8_tensor_static(weight: torch.Tensor) -> Built:
    return _fp8_from_checkpoint(weight, "tensor", static=True)


def build_fp8_channel_dynamic(weight: torch.Tensor) -> Built:
    return _fp8_from_checkpoint(weight, "channel", static=False)


def build_fp8_block_dynamic(weight: torch.Tensor) -> Built:
    return _fp8_from_checkpoint(weight, "block", static=False)


# ----------------------------------------------------------------------------- 4-bit builders
def _uint4(weight: torch.Tensor, group: int, act_order: bool) -> Built:
    """Round-to-nearest asymmetric 4-bit weights in the layout every 4-bit method (AWQ, GPTQ,
    compressed-tensors WNA16) is repacked into after loading, and the HPU 4-bit forward: dequantize
    with the seam's convert_from_uint4 to the activation dtype, then one matmul. With `act_order`
    the rows are grouped in a shuffled order and the kernel reads each row's group from g_idx."""
    from vllm_gaudi_platform import seam
    from vllm_gaudi_quant.methods.uint4 import pack_cols

    w = weight.float().t()  # [K, N]
    k = w.shape[0]
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(0))] = (
            torch.arange(k) // group
        )
    else:
        g_idx = torch.arange(k) // group
    onehot = torch.nn.functional.one_hot(g_idx, k // group).t().bool()  # [G, K]
    lo = torch.stack([w[rows].amin(0) for rows in onehot]).clamp(max=0)
    hi = torch.stack([w[rows].amax(0) for rows in onehot]).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = (torch.round(w / scales[g_idx]) + zeros[g_idx]).clamp(0, 15)
    qweight, qzeros = pack_cols(q.long()), pack_cols(zeros.long())
    scales = scales.to(torch.bfloat16)
    gidx = g_idx.to(torch.int32) if act_order else None
    kernels = seam.backend()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x @ kernels.convert_from_uint4(qweight, scales, qzeros, x.dtype, gidx)

    return Built(forward, [qweight, qzeros, scales] + ([gidx] if act_order else []))


def build_uint4_g128(weight: torch.Tensor) -> Built:
    return _uint4(weight, 128, act_order=False)


def build_uint4_g128_act_order(weight: torch.Tensor) -> Built:
    return _uint4(weight, 128, act_order=True)


# ----------------------------------------------------------------------------- INC FP8 builder
def build_inc_fp8(weight: torch.Tensor) -> Built:
    """INC FP8 as `--quantization inc` runs it in emulation: neural-compressor's CPU path measures
    the layer's input range (MEASURE), then keeps an FP8 weight and quantizes-dequantizes inputs
    with per-tensor maxabs_arbitrary scales (QUANTIZE, use_qdq). Its vLLM layer wrappers share this
    linear code."""
    import json
    import tempfile

    from neural_compressor.torch.algorithms.fp8_quant import finish_measurements, prep_model
    from neural_compressor.torch.algorithms.fp8_quant._core.quantized_func_wrappers import (
        clear_quantized_func_wrapper_factory,
        init_quantized_func_wrapper_factory,
    )

    work = tempfile.mkdtemp(prefix="inc_bench_")
    base = {
        "observer": "maxabs",
        "use_qdq": "True",
        "scale_method": "maxabs_arbitrary",
        "hp_dtype": "bf16",
        "dump_stats_path": os.path.join(work, "m"),
    }

    def prepared(mode: str) -> torch.nn.Module:
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        layer.weight.data.copy_(weight)
        layer = torch.nn.Sequential(layer)  # neural-compressor patches children of a module
        path = os.path.join(work, f"{mode}.json")
        with open(path, "w") as f:
            json.dump({**base, "mode": mode}, f)
        init_quantized_func_wrapper_factory()
        try:
            prep_model(layer, path)
        finally:
            clear_quantized_func_wrapper_factory()
        return layer

    measured = prepared("MEASURE")
    calib = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for _ in range(4):
            measured((torch.randn(16, weight.shape[1], generator=calib) * 0.5).to(weight.dtype))
    finish_measurements(measured)
    quantized = prepared("QUANTIZE")
    tensors = [t for t in quantized.state_dict().values() if isinstance(t, torch.Tensor)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return quantized(x)

    return Built(forward, tensors)


# name -> (builder, weight-bytes target as a fraction of bf16)
METHODS: dict[str, tuple[Callable[[torch.Tensor], Built], float]] = {
    "fp8 per-tensor, static act": (build_fp8_tensor_static, 0.55),
    "fp8 per-channel, dynamic act": (build_fp8_channel_dynamic, 0.55),
    "fp8 block 128x128, dynamic act": (build_fp8_block_dynamic, 0.55),
    # AWQ, GPTQ and compressed-tensors WNA16 all run this layout once loaded.
    "4-bit g128 (awq/gptq/ct-wna16)": (build_uint4_g128, 0.30),
    "4-bit g128 act-order (gptq)": (build_uint4_g128_act_order, 0.30),
    "inc fp8 (neural-compressor qdq)": (build_inc_fp8, 0.55),
}


# ----------------------------------------------------------------------------- FP8 MoE
MOE_SHAPE = {"experts": 8, "top_k": 2, "hidden": 1024, "inter": 3584}  # Mixtral's ratios / 4


def moe_layer(shape: dict[str, int], quant_config: object, index: int, tensors) -> Any:
    """vLLM's MoE layer (Mixtral's checkpoint names) of `shape` through `quant_config`'s method,
    loaded with `tensors(expert, proj, rows, cols)` -> [(name suffix, tensor)], weights processed.
    Call under `set_current_vllm_config`, after `single_process_parallel`."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    e, k, h, n = (shape[key] for key in ("experts", "top_k", "hidden", "inter"))
    layer = FusedMoEFactory(
        num_experts=e,
        top_k=k,
        hidden_size=h,
        intermediate_size=n,
        params_dtype=torch.bfloat16,
        renormalize=True,
        quant_config=quant_config,
        prefix=f"model.layers.{index}.block_sparse_moe.experts",
        ckpt_names=("w1", "w2", "w3"),
    ).routed_experts
    loaded = []
    for expert in range(e):
        for proj, (rows, cols) in (("w1", (n, h)), ("w3", (n, h)), ("w2", (h, n))):
            loaded += [
                (f"{expert}.{proj}.{suffix}", value)
                for suffix, value in tensors(expert, proj, rows, cols)
            ]
    created = {name for name, _ in layer.named_parameters()}
    missing = created - set(layer.load_weights(loaded))  # a generator: loads as it is read
    if missing:
        raise RuntimeError(f"MoE layer parameters not loaded: {sorted(missing)}")
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def fp8_tensors(block: tuple[int, int] | None):
    """`moe_layer` tensors of vLLM's `fp8` format: block scales, or per-tensor weight scales
    with a static input scale."""
    from vllm_gaudi_quant.methods.fp8 import CHECKPOINT_FP8_MAX, FP8_DTYPE

    def tensors(expert: int, proj: str, rows: int, cols: int):
        w = _weight(rows, cols, 31 * expert + len(proj) + ord(proj[1])).float()
        if block:
            bn, bk = block
            tiles = w.reshape(rows // bn, bn, cols // bk, bk).abs().amax(dim=(1, 3))
            scale = tiles / CHECKPOINT_FP8_MAX
            full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            yield "weight_scale_inv", scale
        else:
            scale = full = w.abs().max() / CHECKPOINT_FP8_MAX
            yield "weight_scale", scale.reshape(())
            yield "input_scale", torch.tensor(4.0 / CHECKPOINT_FP8_MAX)
        yield "weight", (w / full).to(FP8_DTYPE)

    return tensors


def fp8_config(block: tuple[int, int] | None) -> object:
    from vllm_gaudi_quant.methods.fp8 import HpuFp8Config

    config: dict[str, Any] = {"quant_method": "fp8"}
    config["activation_scheme"] = "dynamic" if block else "static"
    if block:
        config["weight_block_size"] = list(block)
    return HpuFp8Config.from_config(config)


def recording_moe_kernels(record: Callable[[str, tuple], None]):
    """Context manager: the seam's MoE kernels call `record(name, args)` before they run."""
    import contextlib

    from vllm_gaudi_platform.seam import backend

    kernels = backend()
    names = ("mixture_of_experts", "mixture_of_experts_fp8")

    @contextlib.contextmanager
    def patched():
        saved = {name: getattr(kernels, name) for name in names}

        def wrap(name: str, inner: Callable):
            def call(*args):
                record(name, args)
                return inner(*args)

            return call

        for name, inner in saved.items():
            setattr(kernels, name, wrap(name, inner))
        try:
            yield
        finally:
            for name, inner in saved.items():
                setattr(kernels, name, inner)

    return patched()


def moe_kernel_bytes(block: tuple[int, int] | None) -> tuple[int, int, str]:
    """(bytes of expert weights and scales passed to the seam's MoE kernel in one forward, the
    bf16 experts' bytes, the kernel's name) for vLLM's `fp8` format through HpuFp8MoEMethod."""
    from vllm.config import VllmConfig, set_current_vllm_config

    e, h, n = (MOE_SHAPE[key] for key in ("experts", "hidden", "inter"))
    recorded: dict[str, int] = {}

    def record(name: str, args: tuple) -> None:
        tensors = [t for a in args if isinstance(a, list) for t in a]
        recorded[name] = sum(t.numel() * t.element_size() for t in tensors)

    with set_current_vllm_config(VllmConfig()):
        single_process_parallel()
        layer = moe_layer(MOE_SHAPE, fp8_config(block), 0 if block else 1, fp8_tensors(block))
        # Four tokens route to up to all 8 experts: the dense pass, whatever the gather setting.
        os.environ["VLLM_MOE_GATHER_MAX_TOKENS"] = "0"
        try:
            with recording_moe_kernels(record), torch.no_grad():
                x = torch.randn(4, h).to(torch.bfloat16)
                layer.quant_method.apply_monolithic(layer, x, torch.randn(4, e))
        finally:
            del os.environ["VLLM_MOE_GATHER_MAX_TOKENS"]
    ((kernel, passed),) = recorded.items()
    return passed, e * 3 * h * n * 2, kernel


def moe_rows() -> None:
    print(
        f"\nFP8 MoE, {MOE_SHAPE['experts']} experts top-{MOE_SHAPE['top_k']}, hidden "
        f"{MOE_SHAPE['hidden']}, intermediate {MOE_SHAPE['inter']}: expert bytes the kernel reads"
    )
    header = f"{'experts':34} {'kernel':24} {'bytes/bf16':>10}"
    print(header)
    print("-" * len(header))
    for label, block in (
        ("fp8 per-tensor, static act (W8A8)", None),
        ("fp8 block 128x128 (W8A16)", (128, 128)),
    ):
        passed, bf16, kernel = moe_kernel_bytes(block)
        print(f"{label:34} {kernel:24} {passed / bf16:>9.3f}x")


# ----------------------------------------------------------------------------- measuring
def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)


def median_ms(a: Callable[[], object], b: Callable[[], object], repeats: int):
    for fn in (a, b, a, b):  # warm-up
        fn()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for i, fn in enumerate((a, b)):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 128])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--moe", action="store_true", help="only the FP8 MoE bytes rows")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_HPU_EMULATION", "cpu")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.moe:
        moe_rows()
        return

    weights = {name: _weight(n, k, i) for i, (name, n, k) in enumerate(LAYER)}
    bf16_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    timed_weight = weights[TIMED[0]]
    xs = {
        t: torch.randn(t, TIMED[2], generator=torch.Generator().manual_seed(t)) for t in args.tokens
    }
    xs = {t: (x * 0.5).to(torch.bfloat16) for t, x in xs.items()}

    header = (
        f"{'method':34} {'bytes/bf16':>10} {'target':>7} {'tokens':>6} {'bf16 ms':>8} "
        f"{'quant ms':>9} {'ratio':>6} {'rel err':>8}"
    )
    print(f"decoder layer of {len(LAYER)} linears; timed linear {TIMED[0]} {TIMED[1]}x{TIMED[2]}")
    print(header)
    print("-" * len(header))
    for name in args.methods:
        build, target = METHODS[name]
        quant_bytes = sum(build(w).nbytes for w in weights.values())
        ratio_bytes = quant_bytes / bf16_bytes
        layer = build(timed_weight)
        for tokens, x in xs.items():
            reference = torch.nn.functional.linear(x, timed_weight)
            out = layer.forward(x)
            rel = float((out.float() - reference.float()).norm() / reference.float().norm())
            float_ms, quant_ms = median_ms(
                lambda x=x: torch.nn.functional.linear(x, timed_weight),
                lambda x=x, layer=layer: layer.forward(x),
                args.repeats,
            )
            flag = "  <- above target" if ratio_bytes > target else ""
            print(
                f"{name:34} {ratio_bytes:>9.3f}x {target:>6.2f}x {tokens:>6} {float_ms:>8.2f} "
                f"{quant_ms:>9.2f} {quant_ms / float_ms:>5.2f}x {rel:>8.4f}{flag}"
            )


if __name__ == "__main__":
    main()
