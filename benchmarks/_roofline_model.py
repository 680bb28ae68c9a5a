"""A roofline MODEL of a Gaudi forward step, call by call through the seam (information only).

Used by `gaudi_roofline.py`; nothing in the product imports it. A step is the list of calls a
decoder model's forward pass makes on a Gaudi for one bucket: the seam's kernels
(`seam/contract.py`, named exactly as there) and the few pieces of device work done by plain
torch ops above the seam (named with a `~`, and where they live). Each call is priced as a Gaudi
executes it: over the WHOLE padded bucket (static shapes: padding rows and padding blocks are
computed and read like real ones), with the KV blocks gathered into a contiguous buffer, and with
the traffic of dequantized weights. A call takes

    seconds = max(HBM bytes / HBM bandwidth, MME FLOPs / MME peak)        (roofline)

and a step is the sum over its calls (per-layer calls times the layer count). The peaks are
Intel's published figures; a real step is slower (kernel launch and pipeline gaps, MME
utilisation of thin matmuls, TPC work, on-die caches), so read the results as lower bounds and
their ratios as the point.

Assumptions, each a choice a reader can change below:
- Activations and KV cache in bf16 (2 bytes). FP8 configs run their linear layers W8A8
  (`cast_to_fp8_v2` of the activations, then `fp8_gemm_v2` at the MME's FP8 peak) and their
  experts on `mixture_of_experts_fp8`; the embedding, router and lm_head stay bf16.
- A tensor larger than on-die SRAM round-trips through HBM between ops that are not fused; the
  graph compiler fuses chains of element-wise ops into one pass (each counted once), not a
  gather into a matmul (`KV_GATHER_PASSES`).
- Element-wise (TPC) work is priced by its bytes only: at 2 bytes per element it is memory
  bound on both Gaudis, whose vector peaks (Gaudi 3: 28.7 bf16 TFLOPS) are not modeled.
- Prompt attention on the causal-only path (no context in the bucket) skips the masked upper
  triangle (FusedSDPA's causal mode); with a mask (context, packed rows) every query-key pair of
  the padded slice is computed.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.seam import contract
from vllm_gaudi_platform.worker.routed_experts import (
    GATHER_COST_AS_STORED,
    dequantized_gather_cost,
    gather_max_tokens,
)

# ----------------------------------------------------------------------------- devices
GAUDI3_PAPER = "Intel Gaudi 3 AI Accelerator White Paper (Intel, 2024), specification tables"
HOT_CHIPS = (
    "R. Kaplan, 'Intel Gaudi 3 AI Accelerator: Architected for Gen AI Training and Inference', "
    "Hot Chips 2024, product-generation table"
)
FP8_PAPER = (
    "J. Lee et al., 'Faster Inference of LLMs using FP8 on the Intel Gaudi', arXiv:2503.09975"
)


@dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes: float  # capacity
    hbm_bw: float  # bytes / s
    mme_bf16: float  # FLOP / s, dense
    mme_fp8: float  # FLOP / s, dense
    sources: tuple[tuple[str, str], ...]  # (figure, where it is published)


GAUDI2 = Device(
    "gaudi2",
    hbm_bytes=96e9,
    hbm_bw=2.46e12,
    mme_bf16=432e12,
    mme_fp8=865e12,
    sources=(
        ("96 GB HBM2E, 2.46 TB/s", f"{HOT_CHIPS}; {GAUDI3_PAPER} (Gaudi 2 column)"),
        ("MME bf16 432 TFLOPS", f"{HOT_CHIPS}; {GAUDI3_PAPER} (Gaudi 2 column)"),
        ("MME fp8 865 TFLOPS", f"{GAUDI3_PAPER} (Gaudi 2 column); {FP8_PAPER}"),
    ),
)
GAUDI3 = Device(
    "gaudi3",
    hbm_bytes=128e9,
    hbm_bw=3.7e12,
    mme_bf16=1835e12,
    mme_fp8=1835e12,
    sources=(
        ("128 GB HBM2e, 3.7 TB/s", f"{GAUDI3_PAPER} (Hot Chips 2024 gives 3.67 TB/s)"),
        ("MME bf16 and fp8 1835 TFLOPS", f"{GAUDI3_PAPER}; {HOT_CHIPS}"),
    ),
)
DEVICES = (GAUDI2, GAUDI3)


# ----------------------------------------------------------------------------- models
@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # per expert for a MoE model
    vocab: int
    experts: int = 0  # 0: dense MLP
    top_k: int = 0
    source: str = ""


LLAMA_8B = Model(
    "llama8b", 4096, 32, 32, 8, 128, 14336, 128256,
    source="meta-llama/Llama-3.1-8B config.json (untied embedding and lm_head)",
)  # fmt: skip
MIXTRAL = Model(
    "mixtral", 4096, 32, 32, 8, 128, 14336, 32000, experts=8, top_k=2,
    source="mistralai/Mixtral-8x7B-v0.1 config.json",
)  # fmt: skip
MODELS = (LLAMA_8B, MIXTRAL)


@dataclass(frozen=True)
class Precision:
    name: str
    weight_bytes: float  # linear and expert weights
    w8a8: bool  # activations cast to FP8, matmuls at the MME's FP8 peak
    moe: str  # "bf16", "w8a8" (mixture_of_experts_fp8) or "w8a16" (dequantized per call)


BF16 = Precision("bf16", 2.0, False, "bf16")
FP8 = Precision("fp8", 1.0, True, "w8a8")
# Block-scaled FP8 experts (methods/fp8_moe.py): dequantized to bf16 on every call.
FP8_W8A16_MOE = Precision("fp8", 1.0, True, "w8a16")
PRECISIONS = (BF16, FP8)

ACT = 2.0  # bytes per activation / KV element (bf16)
KV_GATHER_PASSES = 3  # paged_decode's index_select reads the blocks, writes the copy, bmm reads it
SCORE_PASSES = 5  # fp32 decode scores: bmm writes; fused bias/max/exp reads+writes; sum, bmm read


def _shared_mask_bytes() -> int:
    """attention/metadata.py's SHARED_MASK_BYTES, read from its source (importing the module
    would import vLLM): past this many bytes of masks per step, each layer builds its own."""
    path = Path(contract.__file__).parent.parent / "attention" / "metadata.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SHARED_MASK_BYTES" for t in node.targets
        ):
            expr = compile(ast.Expression(node.value), str(path), "eval")
            return int(eval(expr, {"__builtins__": {}}))  # an int expression: `256 << 20`
    raise LookupError(f"SHARED_MASK_BYTES is no longer assigned in {path}")


SHARED_MASK_BYTES = _shared_mask_bytes()


# ----------------------------------------------------------------------------- the seam tie
def _contract_names() -> set[str]:
    return {n for n in vars(contract.HpuBackend) if not n.startswith("_")}


# Contract calls a decoder step makes and this model prices.
MODELED = (
    "rms_norm",
    "linear",
    "cast_to_fp8_v2",
    "fp8_gemm_v2",
    "apply_rotary_pos_emb",
    "fused_sdpa",
    "paged_decode",
    "mixture_of_experts",
    "mixture_of_experts_fp8",
)
# Device runtime, graphs and streams: no HBM traffic of a step's own.
RUNTIME = (
    "Event", "Graph", "Stream", "current_stream", "device_count", "device_name", "fp8_max",
    "graphs_supported", "mark_step", "mem_get_info", "memory_allocated", "set_device", "stream",
    "synchronize", "torch_device",
)  # fmt: skip
_missing = sorted(set(MODELED + RUNTIME) - _contract_names())
if _missing:  # a renamed or removed seam call breaks the model, not silently its figures
    raise ImportError(f"seam/contract.py no longer has {_missing}: update the roofline model")
# Kernels of the contract a Llama/Mixtral-shaped step does not use here (FP8 KV cache, 4-bit
# weights, LoRA, MLA, KV block copies between steps).
NOT_MODELED = tuple(sorted(_contract_names() - set(MODELED) - set(RUNTIME)))


# ----------------------------------------------------------------------------- calls
@dataclass(frozen=True)
class Call:
    name: str  # a seam contract method, or "~what (where)" for device work above the seam
    bytes: float
    flops: float = 0.0
    fp8: bool = False  # on the MME's FP8 peak
    per_layer: bool = True  # False: once per step

    def __post_init__(self) -> None:
        assert self.name.startswith("~") or self.name in MODELED, self.name

    def seconds(self, dev: Device) -> float:
        peak = dev.mme_fp8 if self.fp8 else dev.mme_bf16
        return max(self.bytes / dev.hbm_bw, self.flops / peak)

    def hbm_bound(self, dev: Device) -> bool:
        peak = dev.mme_fp8 if self.fp8 else dev.mme_bf16
        return self.bytes / dev.hbm_bw >= self.flops / peak


@dataclass(frozen=True)
class Shape:
    """What one forward pass computes: a bucket, or a step as traced (unpadded)."""

    phase: str  # "prompt" or "decode"
    rows: int  # prefill rows, or decoding sequences
    query: float  # tokens per row (1 for decode; the mean for a traced prompt step)
    ctx_blocks: int  # prompt: context blocks per row; decode: blocks of the whole batch

    @property
    def tokens(self) -> float:
        return self.rows * self.query


@dataclass(frozen=True)
class Options:
    moe_gather: bool = True  # goal 2: low-batch gather of the routed experts
    masks_per_step: bool = True  # goal 3: a step's masks built once, not per layer
    block_size: int = 128


def linear(t: float, n_in: int, n_out: int, prec: Precision) -> list[Call]:
    """A linear layer's matmul: `linear` in bf16, `cast_to_fp8_v2` + `fp8_gemm_v2` in W8A8."""
    flops = 2 * t * n_in * n_out
    if not prec.w8a8:
        return [Call("linear", ACT * t * (n_in + n_out) + prec.weight_bytes * n_in * n_out, flops)]
    return [
        Call("cast_to_fp8_v2", (ACT + 1) * t * n_in),
        Call(
            "fp8_gemm_v2",
            t * n_in + prec.weight_bytes * n_in * n_out + ACT * t * n_out,
            flops,
            fp8=True,
        ),
    ]


MASK_BUILD = "~build slice mask (attention/metadata.py)"
MASK_TO_BIAS = "~bool mask to bf16 bias (seam/gaudi fused_sdpa)"


def _prompt_attention(m: Model, s: Shape, o: Options) -> list[Call]:
    h, hk, d, bs = m.heads, m.kv_heads, m.head_dim, o.block_size
    rows, q = s.rows, s.query
    if s.ctx_blocks == 0:
        # Causal over each row's own tokens (FusedSDPA, is_causal): flash-style, no mask.
        io = ACT * rows * q * d * (2 * h + 2 * hk)
        return [Call("fused_sdpa", io, 4 * rows * h * d * q * (q + 1) / 2)]
    n_ctx = s.ctx_blocks * bs
    kv_row = ACT * hk * 2 * d  # bytes of one token's key and value
    calls = [
        # impl.py: one index_select of the context blocks, then cat with the new keys/values.
        Call("~gather context blocks (attention/impl.py)", 2 * rows * n_ctx * kv_row),
        Call(
            "~cat context + new keys/values (attention/impl.py)",
            rows * (2 * n_ctx + 2 * q) * kv_row,
        ),
    ]
    kept = 0.0
    step = envs.prefill_query_slice()
    for q0 in range(0, math.ceil(q), step):
        q1 = min(q0 + step, q)
        keys, width = n_ctx + q1, q1 - q0
        elems = rows * width * keys
        io = ACT * rows * (2 * h * width * d + 2 * hk * keys * d)
        # The bool mask becomes an additive bf16 bias in every call (seam/gaudi's
        # _additive_mask: read 1 B, write 2 B), which FusedSDPA reads (2 B).
        calls.append(Call(MASK_TO_BIAS, 3 * elems))
        calls.append(Call("fused_sdpa", io + 2 * elems, 4 * rows * h * d * width * keys))
        # Building the mask (metadata._build_slice_mask, element-wise ops fused: 1 B written).
        shared = o.masks_per_step and kept + elems <= SHARED_MASK_BYTES
        kept += elems if shared else 0
        calls.append(Call(MASK_BUILD, elems, per_layer=not shared))
    return calls


def _decode_attention(m: Model, s: Shape, o: Options) -> list[Call]:
    h, hk, d, bs, nb = m.heads, m.kv_heads, m.head_dim, o.block_size, s.ctx_blocks
    kv = nb * bs * hk * 2 * d * ACT
    scores = nb * bs * h * 4.0  # fp32
    io = KV_GATHER_PASSES * kv + SCORE_PASSES * scores + nb * bs * 4  # + the slot bias read
    io += 2 * nb * h * d * 4 + 2 * ACT * s.rows * h * d  # per-block partial outputs; q and out
    return [
        Call("paged_decode", io, 4 * nb * bs * h * d),
        # The slot bias, built on the device once per step (metadata.decode_blocks_for).
        Call("~build decode slot bias (attention/metadata.py)", nb * bs * 4, per_layer=False),
    ]


def _experts(m: Model, t: float, prec: Precision, o: Options) -> list[Call]:
    """Router, then the fused MoE kernel over the experts handed to it (all, or the gathered
    routed ones: worker/routed_experts.py), with W8A16's per-call dequantization."""
    e, k, per_expert = m.experts, m.top_k, 3 * m.hidden * m.intermediate  # w13 [2I,H], w2 [H,I]
    calls = linear(t, m.hidden, e, BF16)  # the router gate stays bf16
    cost = GATHER_COST_AS_STORED if prec.moe != "w8a16" else dequantized_gather_cost(1, ACT)
    slots = math.ceil(t) * k
    gather = o.moe_gather and t <= gather_max_tokens(e, k, cost) and slots < e
    n = slots if gather else e
    stored = prec.weight_bytes if prec.moe != "bf16" else ACT
    if gather:
        copy = 2 * n * per_expert * stored  # the gather reads the chosen experts, writes a copy
        calls.append(Call("~gather routed experts (worker/routed_experts.py)", copy))
    io = ACT * t * m.hidden * 2 + 2 * ACT * t * k * 3 * m.intermediate  # tokens, intermediates
    flops = 2 * t * k * per_expert
    if prec.moe == "w8a8":
        calls.append(Call("cast_to_fp8_v2", (ACT + 1) * t * m.hidden))
        calls.append(Call("mixture_of_experts_fp8", io + n * per_expert * stored, flops, fp8=True))
        return calls
    if prec.moe == "w8a16":
        dequant = n * per_expert * (stored + ACT)  # read FP8, write bf16, per call
        calls.append(Call("~dequantize experts to bf16 (methods/fp8_moe.py)", dequant))
    calls.append(Call("mixture_of_experts", io + n * per_expert * ACT, flops))
    return calls


@cache
def step_calls(m: Model, prec: Precision, s: Shape, o: Options = Options()) -> tuple[Call, ...]:
    """Every call of one forward pass of shape `s` (per-layer calls once; see `per_layer`)."""
    t, hd, h, hk, d = s.tokens, m.hidden, m.heads, m.kv_heads, m.head_dim
    layer: list[Call] = [
        Call("rms_norm", 4 * ACT * t * hd),  # with the residual add fused: 2 reads, 2 writes
        *linear(t, hd, (h + 2 * hk) * d, prec),
        Call("apply_rotary_pos_emb", 2 * ACT * t * (h + hk) * d + 2 * ACT * t * d),
        # impl.py: cat(k, v) then an index_put into the cache (no seam call).
        Call("~KV cache write (attention/impl.py)", 4 * ACT * t * hk * 2 * d),
        *(_prompt_attention if s.phase == "prompt" else _decode_attention)(m, s, o),
        *linear(t, h * d, hd, prec),
        Call("rms_norm", 4 * ACT * t * hd),
    ]
    if m.experts:
        layer += _experts(m, t, prec, o)
    else:
        layer += linear(t, hd, 2 * m.intermediate, prec)
        layer.append(Call("~SiluAndMul (ops wheel, torch ops)", 3 * ACT * t * m.intermediate))
        layer += linear(t, m.intermediate, hd, prec)
    once = [
        Call("~embedding lookup", 2 * ACT * t * hd, per_layer=False),
        Call("rms_norm", 2 * ACT * s.rows * hd, per_layer=False),
        # Logits for one token per sequence (the padded batch), lm_head in bf16.
        *(Call(c.name, c.bytes, c.flops, c.fp8, False) for c in linear(s.rows, hd, m.vocab, BF16)),
    ]
    return tuple(layer + once)


def step_seconds(m: Model, prec: Precision, s: Shape, dev: Device, o: Options = Options()) -> float:
    return sum(c.seconds(dev) * (m.layers if c.per_layer else 1) for c in step_calls(m, prec, s, o))


def step_bytes(m: Model, prec: Precision, s: Shape, o: Options = Options()) -> float:
    return sum(c.bytes * (m.layers if c.per_layer else 1) for c in step_calls(m, prec, s, o))


def hbm_bound_share(m: Model, prec: Precision, s: Shape, dev: Device) -> float:
    """Share of the step's modeled time spent in calls limited by HBM bandwidth."""
    calls = step_calls(m, prec, s, Options())
    times = [(c.seconds(dev) * (m.layers if c.per_layer else 1), c.hbm_bound(dev)) for c in calls]
    return sum(t for t, bound in times if bound) / sum(t for t, _ in times)


def weight_bytes(m: Model, prec: Precision) -> float:
    """Bytes of the weights held on the device (embedding and lm_head in bf16)."""
    hd, d = m.hidden, m.head_dim
    attn = hd * (m.heads + 2 * m.kv_heads) * d + m.heads * d * hd
    mlp = 3 * hd * m.intermediate * max(1, m.experts)
    router = hd * m.experts * ACT
    return m.layers * ((attn + mlp) * prec.weight_bytes + router) + 2 * m.vocab * hd * ACT


def kv_bytes_per_token(m: Model) -> float:
    return m.layers * m.kv_heads * 2 * m.head_dim * ACT
