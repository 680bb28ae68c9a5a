"""`vllm-gaudi selftest`'s probes: what the device does where Habana's sources do not say.

Each probe turns one item the stand-in's README lists as "not established" into an observation:
not pass/fail, but what the device did, the default of ours that rests on it, and whether the
observation confirms or contradicts that default (with the setting to change when it
contradicts). A probe that decides a setting's value says so in `decides`: the platform takes it
from a report file (VLLM_HPU_SELFTEST_REPORT, `selftest_defaults.py`).

On the emulation and the stand-in the answers come from our model of the device, not from
hardware: `selftest.py` stamps every probe with where its answer came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_gaudi_platform.commands.selftest_kernels import _randn, fp8_moe_inputs


@dataclass(frozen=True)
class Probe:
    id: str
    question: str
    default: str  # the default of ours that rests on the answer
    observe: Callable[[Any, torch.device, dict[str, Any]], dict[str, Any]]


def _outcome(answer: str, observed: str, verdict: str, advice: str = "", **extra: Any):
    return {"answer": answer, "observed": observed, "verdict": verdict, "advice": advice, **extra}


def _refused(exc: Exception) -> str:
    return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().double() - b.cpu().double()).abs().max())


# ----------------------------------------------------------------------------- FusedSDPA masks
def _raw_sdpa(kernels: Any) -> Callable[..., torch.Tensor]:
    """FusedSDPA as the device provides it, without the seam's mask conversion (the kernel the
    Gaudi backend's attention module calls); in emulation the emulated kernel (our model)."""
    if kernels.IS_EMULATED:
        return lambda q, k, v, mask: kernels.fused_sdpa(q, k, v, attn_mask=mask)
    from vllm_gaudi_platform.seam.gaudi import attention

    fused = attention.FusedSDPA
    return lambda q, k, v, mask: fused.apply(q, k, v, mask, 0.0, False, None, "None", None, None,
                                             "left")  # fmt: skip


def _sdpa_mask_probe(mask_kind: str):
    def observe(kernels, device, context):
        q, k, v = (_randn(1, 2, 16, 32, seed=s, dtype=torch.bfloat16).to(device) for s in (1, 2, 3))
        allowed = torch.ones(16, 16, dtype=torch.bool).tril()[None, None]
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, -1e30)
        mask = allowed if mask_kind == "bool" else additive  # float32 under bf16 queries
        expected = kernels.fused_sdpa(q, k, v, attn_mask=additive.to(torch.bfloat16).to(device))
        raw = _raw_sdpa(kernels)  # outside the try: an unreachable kernel is no observation
        try:
            out = raw(q, k, v, mask.to(device))
        except Exception as exc:
            return _outcome("no", _refused(exc), "confirms", "keep the conversion")
        error = _max_error(out, expected)
        if error <= 3e-2:
            return _outcome(
                "yes",
                f"accepted, same result as the additive bf16 mask (max error {error:.2g})",
                "contradicts",
                "the conversion is not needed: the seam could hand this mask to the kernel as is",
            )
        return _outcome(
            "no",
            f"accepted, but a different result (max error {error:.2g})",
            "confirms",
            "keep the conversion",
        )

    return observe


# ----------------------------------------------------------------------------- HPU graphs
def _graph_probe(kernels, device, context):
    if not kernels.graphs_supported():
        return _outcome(
            "not observed",
            "graphs exist in lazy mode only (PT_HPU_LAZY_MODE=1); this process is not",
            "informs",
            "run the selftest with PT_HPU_LAZY_MODE=1 to observe graphs",
        )
    x = torch.ones(256, 1024, device=device)
    kernels.synchronize()
    before = kernels.memory_allocated()

    def forward():
        hidden = torch.ops.aten.mul(x, 2.0)  # an intermediate the replay could keep or drop
        return torch.ops.aten.add(hidden.exp(), 1.0).sum(-1)

    graph = kernels.Graph("selftest")
    out = graph.capture(forward, {"x": x})
    kernels.synchronize()
    held = kernels.memory_allocated() - before
    x.fill_(0.5)
    again = graph.replay({"x": x})
    kernels.synchronize()
    follows = bool(torch.allclose(again.cpu(), torch.full((256,), 1024 * (math.e + 1))))
    intermediate = x.numel() * x.element_size()
    kept = held >= intermediate
    return _outcome(
        "yes" if kept else "no",
        f"replay follows in-place input updates: {'yes' if follows else 'NO'}; memory held by "
        f"the captured graph {held} bytes (its one intermediate is {intermediate} bytes, its "
        f"output {out.numel() * out.element_size()})",
        "confirms" if follows else "contradicts",
        "VLLM_GRAPH_RESERVED_MEM sizes the memory graphs keep: compare the bytes held per graph "
        "with it",
        held_bytes=held,
        replay_follows_inputs=follows,
    )


# ----------------------------------------------------------------------------- mixture of experts
def _moe_skip_probe(kernels, device, context):
    moe = context["moe"]  # selftest_timing.moe_batch1: timings of the same calls
    ratio, threshold = moe["dense_over_routed"], math.sqrt(moe["experts"] / moe["topk"])
    finite = moe["nan_unrouted_finite"]
    skips = finite and ratio < threshold
    observed = (
        f"at batch 1 a call over {moe['experts']} experts costs {ratio:.2f}x a call over the "
        f"{moe['topk']} routed ones (skipping: ~1, reading all: ~{moe['experts'] // moe['topk']});"
        f" NaN weights in unrouted experts {'leave the result finite' if finite else 'reach it'}"
    )
    if skips:
        return _outcome(
            "yes",
            observed,
            "contradicts",
            "set VLLM_MOE_GATHER_MAX_TOKENS=0 (the gather only adds traffic)",
            decides={"VLLM_MOE_GATHER_MAX_TOKENS": "0"},
        )
    return _outcome(
        "no",
        observed,
        "confirms",
        "keep VLLM_MOE_GATHER_MAX_TOKENS unset (each layer gathers while it saves bytes)",
        decides={"VLLM_MOE_GATHER_MAX_TOKENS": None},
    )


def _fp8_moe_model(inputs, how: str, tensor_amax: list[torch.Tensor], top: float) -> torch.Tensor:
    """The FP8 MoE with no intermediate scales, as one model of the kernel: the intermediate
    quantized per token, per tensor, or not at all (float64 otherwise)."""
    xq, x_scale, table, weights, ups, downs = inputs
    f64 = torch.float64
    x = xq.to(f64) * x_scale.to(f64)
    out = torch.zeros(x.shape, dtype=f64)
    for t in range(x.shape[0]):
        for slot, e in enumerate(table[t].tolist()):
            up = ups[e][0].to(f64) * ups[e][1].to(f64)[:, None]
            down = downs[e][0].to(f64) * downs[e][1].to(f64)[:, None]
            gate, lin = (x[t] @ up.t()).chunk(2)
            h = gate * torch.sigmoid(gate) * lin
            if how != "none":
                amax = h.abs().max()  # one token: per token and per expert call differ below
                scale = (amax if how == "per token" else tensor_amax[e]) / top
                h = (h / scale).float().to(torch.float8_e4m3fn).to(f64) * scale
            out[t] += float(weights[t, slot]) * (h @ down.t())
    return out


def _fp8_moe_probe(kernels, device, context):
    inputs = fp8_moe_inputs()
    xq, x_scale, table, weights, ups, downs = inputs
    # The per-tensor model: one scale per expert call, from all of that expert's tokens.
    tensor_amax = []
    top = kernels.fp8_max(torch.float8_e4m3fn)
    f64 = torch.float64
    x = xq.to(f64) * x_scale.to(f64)
    for e in range(len(ups)):
        rows = (table == e).any(-1)
        gate, lin = (x[rows] @ (ups[e][0].to(f64) * ups[e][1].to(f64)[:, None]).t()).chunk(2, -1)
        tensor_amax.append((gate * torch.sigmoid(gate) * lin).abs().max())
    move = lambda t: t.to(device)  # noqa: E731
    try:
        out = kernels.mixture_of_experts_fp8(
            move(xq), move(table), move(weights), [move(w) for w, _ in ups],
            [move(w) for w, _ in downs], move(x_scale), None, [move(s) for _, s in ups],
            [move(s) for _, s in downs], True, "silu", 0, len(ups) - 1,
        ).cpu()  # fmt: skip
    except Exception as exc:
        return _outcome("refused", _refused(exc), "contradicts", "report this")
    errors = {
        how: _max_error(out, _fp8_moe_model(inputs, how, tensor_amax, top)) for how in _FP8_MODELS
    }
    nearest = min(errors, key=errors.__getitem__)
    observed = ", ".join(f"{how} {err:.3g}" for how, err in errors.items())
    return _outcome(
        nearest,
        f"nearest model: the intermediate quantized {nearest} (max error against each: {observed})",
        "confirms" if nearest == "per token" else "contradicts",
        ""
        if nearest == "per token"
        else "the emulation and the stand-in quantize per token: "
        "report this so their model follows the device",
        errors=errors,
    )


_FP8_MODELS = ("per token", "per tensor", "none")


def _moe_overload_probe(kernels, device, context):
    if kernels.IS_EMULATED:
        return _outcome(
            "not modelled",
            "the emulation has no operator registry: its FP8 MoE is one Python function",
            "informs",
        )
    try:
        op = torch.ops.hpu.mixture_of_experts
        schemas = [str(getattr(op, name)._schema) for name in op.overloads()]
    except Exception as exc:
        return _outcome("refused", _refused(exc), "informs")
    return _outcome(
        f"{len(schemas)} overloads",
        "; ".join(schemas),
        "informs",
        "the seam passes the FP8 MoE's arguments by name: compare these schemas with it",
        schemas=schemas,
    )


# ----------------------------------------------------------------------------- rotary, 4-bit
def _rotary_probe(kernels, device, context):
    table = torch.rand(16, 1, 64, generator=torch.Generator().manual_seed(3)) * 6
    cos, sin = table.cos(), table.sin()
    p = _randn(5, 2, 64, seed=4)
    positions = torch.tensor([3, 0, 7, 7, 12])
    found = []
    for what, kwargs, gathered in (
        ("position_ids", {"position_ids": positions}, positions),
        ("offset", {"offset": 2}, torch.arange(5) + 2),
    ):
        expected = kernels.apply_rotary_pos_emb(
            p.to(device), cos[gathered].to(device), sin[gathered].to(device), None, 0, 0
        )
        args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        try:
            out = kernels.apply_rotary_pos_emb(
                p.to(device), cos.to(device), sin.to(device), args.get("position_ids"),
                args.get("offset", 0), 0,
            )  # fmt: skip
        except Exception as exc:
            found.append(f"{what}: {_refused(exc)}")
            continue
        if out.shape != expected.shape:
            found.append(f"{what}: accepted, result shape {tuple(out.shape)}")
        else:
            error = _max_error(out, expected)
            index = "rows of the cos/sin tables" if error < 1e-4 else "something else"
            found.append(f"{what}: indexes {index} (max error {error:.2g})")
    return _outcome(
        "; ".join(found),
        "; ".join(found),
        "informs",
        "the rotary family passes gathered cos/sin, so no default rests on this yet",
    )


def _uint4_fp16_probe(kernels, device, context):
    g = torch.Generator().manual_seed(5)
    words = torch.randint(-(2**31), 2**31 - 1, (36, 2), generator=g).to(torch.int32)
    scales = torch.rand(4, 16, generator=g).to(torch.float16)
    args = (words[:32].to(device), scales.to(device), words[32:].to(device))
    try:
        out = kernels.convert_from_uint4(*args, torch.float16).cpu()
    except Exception as exc:
        return _outcome(
            "no", _refused(exc), "contradicts", "dequantize to bfloat16 for fp16 models"
        )
    wide = kernels.convert_from_uint4(*args, torch.float32).cpu()
    error = _max_error(out, wide.half())
    same = out.dtype == torch.float16 and error == 0
    return _outcome(
        "yes" if same else "no",
        f"float16 output: dtype {out.dtype}, max difference from the float32 result rounded to "
        f"float16 {error:.2g}",
        "confirms" if same else "contradicts",
        "" if same else "dequantize fp16 checkpoints' 4-bit weights through bfloat16",
    )


# ----------------------------------------------------------------------------- memory, storages
def memory_figures(kernels, device) -> dict[str, Any]:
    """mem_get_info and memory_allocated around a 64 MiB allocation."""
    size = 64 << 20
    kernels.synchronize()
    free0, total = kernels.mem_get_info()
    alloc0 = kernels.memory_allocated()
    block = torch.empty(size, dtype=torch.uint8, device=device)
    block.fill_(1)
    kernels.synchronize()
    free1, _ = kernels.mem_get_info()
    alloc1 = kernels.memory_allocated()
    del block
    kernels.synchronize()
    return {
        "total_bytes": total,
        "free_bytes": free0,
        "allocated_bytes": alloc0,
        "allocation_bytes": size,
        "free_drop_bytes": free0 - free1,
        "allocated_rise_bytes": alloc1 - alloc0,
    }


def _memory_probe(kernels, device, context):
    mem = context["memory"]
    size = mem["allocation_bytes"]
    falls = abs(mem["free_drop_bytes"] - size) <= size // 8
    rises = abs(mem["allocated_rise_bytes"] - size) <= size // 8
    return _outcome(
        "yes" if falls and rises else "no",
        f"total {mem['total_bytes'] / 2**30:.2f} GiB, free {mem['free_bytes'] / 2**30:.2f} GiB; "
        f"a {size >> 20} MiB allocation lowers free by {mem['free_drop_bytes'] / 2**20:.1f} MiB "
        f"and raises allocated by {mem['allocated_rise_bytes'] / 2**20:.1f} MiB",
        "confirms" if falls and rises else "contradicts",
        ""
        if falls and rises
        else "the KV cache is sized from these figures after the profile "
        "run: check gpu_memory_utilization / kv_cache_memory_bytes by hand",
    )


def _set_storage_probe(kernels, device, context):
    try:
        base = torch.arange(64.0, device=device)
        view = torch.empty(0, device=device)
        view.set_(base.untyped_storage(), 8, (4, 4), (4, 1))
        aliased = bool(torch.equal(view.cpu(), torch.arange(8.0, 24.0).view(4, 4)))
        view.zero_()
        shared = float(base[8:24].abs().sum().cpu()) == 0.0
    except Exception as exc:
        return _outcome("no", _refused(exc), "contradicts", "the offloading connector cannot run")
    works = aliased and shared
    return _outcome(
        "yes" if works else "no",
        f"a view set onto a device tensor's storage reads it: {aliased}; writes reach it: {shared}",
        "confirms" if works else "contradicts",
        "" if works else "vLLM's offloading connector's canonical tensors will not alias the cache",
    )


def _uint64_probe(kernels, device, context):
    """What vLLM's Mamba prefix caching does with its copy descriptors (mamba_utils): uint64
    buffers on the device, filled from host buffers a slice at a time, read back as Python ints
    (the platform's `batch_memcpy` stand-in reads them with .tolist())."""
    pointers = [2**40 + 64, 2**40 + 4096, 2**63 + 8]
    try:
        host = torch.tensor([*pointers, 0], dtype=torch.uint64)
        on_device = torch.zeros(4, dtype=torch.uint64, device=device)
        on_device[:3].copy_(host[:3], non_blocking=True)
        kernels.synchronize()
        read = on_device[:3].tolist()
    except Exception as exc:
        return _outcome("no", _refused(exc), "contradicts", "pass the descriptors as int64")
    works = read == pointers
    return _outcome(
        "yes" if works else "no",
        f"uint64 descriptors copied to the device and read back: {read} (expected {pointers})",
        "confirms" if works else "contradicts",
        "" if works else "Mamba prefix caching's state copies need int64 descriptors here",
    )


PROBES: tuple[Probe, ...] = (
    Probe("sdpa_bool_mask", "Does FusedSDPA take a bool mask?",
          "seam/gaudi converts bool masks to an additive bias in the query's dtype",
          _sdpa_mask_probe("bool")),
    Probe("sdpa_float32_mask_bf16", "Does FusedSDPA take a float32 mask under bf16 queries?",
          "seam/gaudi casts additive masks to the query's dtype", _sdpa_mask_probe("float32")),
    Probe("hpu_graph_tensor_cache", "Does a captured HPU graph keep its intermediates?",
          "VLLM_GRAPH_RESERVED_MEM=0.1", _graph_probe),
    Probe("moe_skips_empty_experts",
          "Does mixture_of_experts skip experts that receive no token?",
          "VLLM_MOE_GATHER_MAX_TOKENS unset (low-batch expert gather on)", _moe_skip_probe),
    Probe("moe_fp8_dynamic_intermediate",
          "How does the FP8 MoE scale the intermediate without intermediate scales?",
          "emulation and stand-in: one scale per token", _fp8_moe_probe),
    Probe("moe_fp8_overload_schemas", "Which overloads does mixture_of_experts have?",
          "seam/gaudi passes the FP8 MoE arguments by name", _moe_overload_probe),
    Probe("rotary_position_ids_offset",
          "What do position_ids / offset of the rotary kernel index?",
          "the rotary family passes gathered cos/sin", _rotary_probe),
    Probe("uint4_float16_output", "Does convert_from_uint4 produce float16?",
          "4-bit float16 models dequantize to float16", _uint4_fp16_probe),
    Probe("device_memory_figures",
          "Do mem_get_info and memory_allocated follow an allocation?",
          "vLLM sizes the KV cache from free memory after the profile run", _memory_probe),
    Probe("set_on_device_storage", "Does Tensor.set_ onto device storage alias it?",
          "vLLM's offloading connector's canonical tensors", _set_storage_probe),
    Probe("uint64_copy_descriptors", "Do uint64 copy descriptors live on the device?",
          "vLLM's Mamba state copies", _uint64_probe),
)  # fmt: skip


def run_probes(kernels: Any, context: dict[str, Any]) -> list[dict[str, Any]]:
    device = kernels.torch_device(0)
    results = []
    for probe in PROBES:
        entry: dict[str, Any] = {
            "id": probe.id,
            "question": probe.question,
            "default": probe.default,
        }
        try:
            entry.update(probe.observe(kernels, device, context))
        except Exception as exc:  # the probe itself failed: that is an observation too
            entry.update(_outcome("error", _refused(exc), "informs", "report this"))
        results.append(entry)
    return results
