"""`vllm-gaudi selftest`'s kernel cases: every kernel of the seam's `HpuBackend` Protocol, run on
the active backend's device and compared with a reference on the same inputs.

On a Gaudi (or over the Habana stand-in) the reference is the CPU emulation (`seam/emulated*.py`);
when the active backend is the emulation itself, it is `selftest_reference.py` (float64, no code
shared with the emulation), so the check is never the emulation against itself.

`TOLERANCE` is the suite's: tests/platform/test_gaudi_seam.py compares the two backends with it.
Against the float64 reference a case also allows one rounding of the kernel's output dtype.
A kernel of the Protocol with no case here is reported as uncovered, and that fails the run.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Backend against backend, per dtype of the compared result: float32 to rounding; bfloat16 at
# 3e-2 absolute (Gaudi's TPC rounds differently from the CPU). FP8 results are compared as
# bfloat16 ones.
TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 0.0},
}
EXACT = {"atol": 0.0, "rtol": 0.0}


def kernel_names() -> list[str]:
    """The kernels of the `HpuBackend` Protocol, in its order: its functions that take a tensor
    or a dtype (the device runtime's functions take neither)."""
    from vllm_gaudi_platform.seam.contract import HpuBackend

    names = []
    for name, member in vars(HpuBackend).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        annotations = [str(p.annotation) for p in inspect.signature(member).parameters.values()]
        if any("torch.Tensor" in a or "torch.dtype" in a for a in annotations):
            names.append(name)
    return names


@dataclass(frozen=True)
class Case:
    kernel: str
    dtype: torch.dtype  # of the compared result
    shape: str
    run: Callable[[Any, Callable[[Any], Any]], torch.Tensor]  # (kernels, to_device) -> result
    exact: bool = False

    def tolerance(self, against_float64: bool) -> dict[str, float]:
        if self.exact:
            return dict(EXACT)
        tol = dict(TOLERANCE[torch.bfloat16 if self.dtype != torch.float32 else torch.float32])
        if against_float64:  # the kernel's own output rounding, which float64 does not have
            tol["rtol"] += torch.finfo(self.dtype).eps
        return tol


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _host(t: Any) -> torch.Tensor:
    return t.detach().cpu()


# ----------------------------------------------------------------------------- attention
def _sdpa(dtype, shape, **options):
    b, hq, hkv, q_len, d = shape

    def run(k, dev):
        q = _randn(b, hq, q_len, d, seed=1, dtype=dtype)
        key = _randn(b, hkv, q_len, d, seed=2, dtype=dtype)
        value = _randn(b, hkv, q_len, d, seed=3, dtype=dtype)
        kwargs = {name: dev(value) for name, value in options.items()}
        return _host(k.fused_sdpa(dev(q), dev(key), dev(value), **kwargs))

    return run


def _mask(b, q_len) -> torch.Tensor:
    mask = torch.rand(b, 1, q_len, q_len, generator=_gen(4)) > 0.3
    return mask | torch.eye(q_len, dtype=torch.bool)


def _flat_blocks(lens: list[int], block: int, num_blocks: int):
    """Gaudi's flat block list for sequences of `lens` tokens, plus one padding entry."""
    free = iter(torch.randperm(num_blocks, generator=_gen(5)).tolist())
    blocks, groups, bias = [], [], []
    for seq, n in enumerate(lens):
        for j in range(-(-n // block)):
            used = min(block, n - j * block)
            blocks.append(next(free))
            groups.append(seq)
            bias.append([0.0] * used + [-math.inf] * (block - used))
    blocks.append(0)
    groups.append(len(lens))
    bias.append([-math.inf] * block)
    return torch.tensor(blocks), torch.tensor(groups), torch.tensor(bias)


def _paged(option: str):
    block, heads, kv_heads, d, lens = 4, 4, 2, 16, [5, 9, 1]

    def run(k, dev):
        cache = _randn(12, block, kv_heads, 2 * d, seed=6)
        query = _randn(len(lens), heads, d, seed=7)
        blocks, groups, bias = _flat_blocks(lens, block, 12)
        kwargs: dict[str, Any] = {}
        if option == "sinks":
            kwargs["sinks"] = dev(torch.tensor([0.1, -0.5, 1.0, 0.0]))
        elif option == "fp8 cache":
            cache = (cache * 8).to(torch.float8_e4m3fn)
            kwargs["kv_scales"] = (dev(torch.tensor(0.125)), dev(torch.tensor(0.125)))
        args = (dev(query), dev(cache), dev(blocks), dev(groups), dev(bias), d**-0.5)
        return _host(k.paged_decode(*args, **kwargs))

    return run


def _mla_prefill(k, dev):
    heads, rank, rope, seq = 4, 16, 8, 6
    query = _randn(1, heads, seq, rank + rope, seed=8)
    latent = _randn(1, seq, rank + rope, seed=9)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    return _host(k.mla_prefill(dev(query), dev(latent), dev(mask), (rank + rope) ** -0.5, rank))


def _mla_decode(k, dev):
    heads, rank, rope, block, lens = 4, 16, 8, 4, [5, 2]
    cache = _randn(8, block, rank + rope, seed=10)
    query = _randn(len(lens), heads, rank + rope, seed=11)
    blocks, groups, bias = _flat_blocks(lens, block, 8)
    args = (dev(query), dev(cache), dev(blocks), dev(groups), dev(bias))
    return _host(k.mla_paged_decode(*args, (rank + rope) ** -0.5, rank))


# ----------------------------------------------------------------------------- dense families
def _rms_norm(dtype, shape):
    def run(k, dev):
        x = _randn(*shape, seed=12, dtype=dtype)
        weight = (1 + _randn(shape[-1], seed=13) / 4).to(dtype)
        return _host(k.rms_norm(dev(x), dev(weight), 1e-6))

    return run


def _linear(dtype, m, n, kk):
    def run(k, dev):
        x = _randn(m, kk, seed=14, dtype=dtype)
        w = (_randn(n, kk, seed=15) / math.sqrt(kk)).to(dtype)
        b = _randn(n, seed=16, dtype=dtype)
        return _host(k.linear(dev(x), dev(w), dev(b)))

    return run


def _rotary(dtype, mode):
    def run(k, dev):
        p = _randn(9, 4, 64, seed=17, dtype=dtype)
        angles = torch.rand(9, 1, 64, generator=_gen(18)) * 6
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        return _host(k.apply_rotary_pos_emb(dev(p), dev(cos), dev(sin), None, 0, mode))

    return run


def _lora(k, dev, expand: bool):
    tokens, width, rank, out_width, slots = 7, 32, 8, 24, 3
    x = _randn(tokens, width, seed=19)
    lora_a = _randn(slots, rank, width, seed=20)
    lora_b = _randn(slots, out_width, rank, seed=21)
    token_lora = torch.tensor([0, 2, -1, 1, 1, -1, 0])
    if not expand:
        return _host(k.lora_shrink(dev(x), dev(lora_a), dev(token_lora), 0.5))
    shrunk = _randn(tokens, rank, seed=22)
    return _host(k.lora_expand(dev(shrunk), dev(lora_b), dev(token_lora)))


# ----------------------------------------------------------------------------- mixture of experts
MOE = {"tokens": 16, "hidden": 32, "inter": 64, "experts": 8, "topk": 2}


def _routing(tokens: int, experts: int, topk: int, seed: int):
    g = _gen(seed)
    table = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    return table, torch.rand(tokens, topk, generator=g)


def _moe(k, dev):
    t, h, i, e, top = MOE.values()
    x = _randn(t, h, seed=23, dtype=torch.bfloat16)
    w12 = [(_randn(2 * i, h, seed=30 + n) / 10).to(torch.bfloat16) for n in range(e)]
    w3 = [(_randn(h, i, seed=50 + n) / 15).to(torch.bfloat16) for n in range(e)]
    table, weights = _routing(t, e, top, 24)
    out = k.mixture_of_experts(
        dev(x), dev(table), dev(weights.to(torch.bfloat16)), dev(w12), dev(w3), True, "silu", 0,
        e - 1,
    )  # fmt: skip
    return _host(out)


def fp8_moe_inputs(experts: int = 6, tokens: int = 12, hidden: int = 32, inter: int = 48):
    """FP8 experts with per-output-channel scales and per-token FP8 activations (Intel's
    per-channel FP8 MoE): (xq, x_scale [tokens, 1], table, router weights bf16, ups, downs), each
    of ups / downs a list of (fp8 weight, float32 scale [out])."""
    fp8, top = torch.float8_e4m3fn, 240.0  # within both generations' E4M3 range

    def quantize(w):
        scale = w.abs().amax(dim=-1) / top
        return (w / scale[:, None]).to(fp8), scale.float()

    ups = [quantize(_randn(2 * inter, hidden, seed=70 + n) / 10) for n in range(experts)]
    downs = [quantize(_randn(hidden, inter, seed=90 + n) / 15) for n in range(experts)]
    x = _randn(tokens, hidden, seed=25)
    x_scale = x.abs().amax(-1, keepdim=True) / top
    table, weights = _routing(tokens, experts, 2, 26)
    return (x / x_scale).to(fp8), x_scale.float(), table, weights.to(torch.bfloat16), ups, downs


def _moe_fp8(k, dev):
    xq, x_scale, table, weights, ups, downs = fp8_moe_inputs()
    static = [torch.tensor(0.004 * (1 + e)) for e in range(len(ups))]
    out = k.mixture_of_experts_fp8(
        dev(xq), dev(table), dev(weights), dev([w for w, _ in ups]), dev([w for w, _ in downs]),
        dev(x_scale), dev(static), dev([s for _, s in ups]), dev([s for _, s in downs]), True,
        "silu", 0, len(ups) - 1,
    )  # fmt: skip
    return _host(out)


def _moe_mxfp4(k, dev):
    tokens, hidden, inter, experts = 6, 64, 64, 4
    g = _gen(27)

    def weight(rows, cols):
        blocks = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 123, (rows, cols // 32), generator=g, dtype=torch.uint8)
        return blocks, scales

    ups = [weight(2 * inter, hidden) for _ in range(experts)]
    downs = [weight(hidden, inter) for _ in range(experts)]
    b12 = [(_randn(2 * inter, seed=110 + n) / 10).to(torch.bfloat16) for n in range(experts)]
    b3 = [(_randn(hidden, seed=120 + n) / 10).to(torch.bfloat16) for n in range(experts)]
    x = _randn(tokens, hidden, seed=28, dtype=torch.bfloat16)
    table, weights = _routing(tokens, experts, 2, 29)
    out = k.mixture_of_experts_mxfp4(
        dev(x), dev(table.to(torch.int32)), dev(weights.to(torch.bfloat16)),
        dev([b for b, _ in ups]), dev([b for b, _ in downs]), dev(b12), dev(b3),
        dev([s for _, s in ups]), dev([s for _, s in downs]), 0, experts - 1, 1.702, 7.0,
    )  # fmt: skip
    return _host(out)


# ----------------------------------------------------------------------------- copies, 4-bit, FP8
def _copy_blocks(dtype):
    def run(k, dev):
        src = _randn(6, 4, 2, 8, seed=31).to(dtype)
        dst = torch.zeros(5, 4, 2, 8).to(dtype)  # host: a swap-out from the device cache
        k.copy_blocks(dev(src), dst, dev(torch.tensor([4, 0, 2])), torch.tensor([1, 3, 0]))
        return dst.view(torch.uint8).to(torch.float32)

    return run


def _uint4(grouped: bool):
    def run(k, dev):
        kk, n, groups = 32, 16, 4
        g = _gen(32)
        words = torch.randint(-(2**31), 2**31 - 1, (kk + groups, n // 8), generator=g)
        qweight, qzeros = words[:kk].to(torch.int32), words[kk:].to(torch.int32)
        scales = torch.rand(groups, n, generator=g).to(torch.bfloat16)
        g_idx = torch.randint(0, groups, (kk,), generator=g, dtype=torch.int32) if grouped else None
        out = k.convert_from_uint4(
            dev(qweight), dev(scales), dev(qzeros), torch.bfloat16, dev(g_idx)
        )
        return _host(out)

    return run


def _fp8_max(k, dev):
    return torch.tensor([k.fp8_max(torch.float8_e4m3fn), k.fp8_max(torch.float8_e5m2)])


def _cast_to_fp8(kind: str, dtype: torch.dtype):
    def run(k, dev):
        x = _randn(6, 10, seed=33, dtype=torch.bfloat16) * 20
        scale = torch.rand(6, 1, generator=_gen(34)) / 10 + 0.01 if kind == "per row" else 0.05
        out, amax = k.cast_to_fp8_v2(dev(x), dev(scale), False, True, dtype)
        return torch.cat([_host(out).float().flatten(), _host(amax).float().flatten()])

    return run


def _cast_from_fp8(k, dev):
    x = (_randn(6, 10, seed=35) * 20).to(torch.float8_e4m3fn)
    scale = torch.rand(10, generator=_gen(36)) / 10 + 0.01  # per column
    return _host(k.cast_from_fp8(dev(x), dev(scale), torch.float32))


def _fp8_gemm(accumulate: bool):
    def run(k, dev):
        m, kk, n = 5, 16, 8
        a = (_randn(m, kk, seed=37) * 4).to(torch.float8_e4m3fn)
        b = (_randn(n, kk, seed=38) * 4).to(torch.float8_e4m3fn)  # a weight stored [N, K]
        a_scale = torch.rand(m, 1, generator=_gen(39)) / 10
        b_scale = torch.rand(n, generator=_gen(40)) / 10
        bias = _randn(n, seed=41, dtype=torch.bfloat16)
        d = _randn(m, n, seed=42, dtype=torch.bfloat16) if accumulate else None
        out = k.fp8_gemm_v2(
            dev(a), False, dev(b), True, dev(d), torch.bfloat16, dev(a_scale), dev(b_scale),
            dev(bias), accumulate,
        )  # fmt: skip
        return _host(out)

    return run


F32, BF16 = torch.float32, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def cases() -> list[Case]:
    """Every case, named by kernel, result dtype and shape (the Gaudi generation is the run's)."""
    mask = _mask(2, 19)
    return [
        Case("fused_sdpa", BF16, "causal [2, 8 q / 2 kv heads, 64, 64]",
             _sdpa(BF16, (2, 8, 2, 64, 64), is_causal=True)),
        Case("fused_sdpa", F32, "bool mask [2, 4 heads, 19, 32]",
             _sdpa(F32, (2, 4, 4, 19, 32), attn_mask=mask)),
        Case("fused_sdpa", F32, "mask + sinks [2, 4 q / 2 kv heads, 19, 32]",
             _sdpa(F32, (2, 4, 2, 19, 32), attn_mask=mask,
                   sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))),
        Case("rms_norm", BF16, "[2, 16, 128]", _rms_norm(BF16, (2, 16, 128))),
        Case("rms_norm", F32, "[1, 7, 64]", _rms_norm(F32, (1, 7, 64))),
        Case("linear", F32, "[5, 16] x [8, 16] + bias", _linear(F32, 5, 8, 16)),
        Case("linear", BF16, "[32, 256] x [128, 256] + bias", _linear(BF16, 32, 128, 256)),
        Case("apply_rotary_pos_emb", BF16, "blockwise [9, 4, 64]", _rotary(BF16, 0)),
        Case("apply_rotary_pos_emb", F32, "pairwise [9, 4, 64]", _rotary(F32, 1)),
        Case("mixture_of_experts", BF16, "silu, 16 tokens, 8 experts top-2, 32 -> 64", _moe),
        Case("mixture_of_experts_fp8", BF16,
             "per-channel, static intermediate, 12 tokens, 6 experts top-2", _moe_fp8),
        Case("mixture_of_experts_mxfp4", BF16, "6 tokens, 4 experts top-2, 64 -> 64",
             _moe_mxfp4),
        Case("copy_blocks", BF16, "device -> host, 3 of [6, 4, 2, 8]", _copy_blocks(BF16),
             exact=True),
        Case("copy_blocks", E4M3, "device -> host, 3 of [6, 4, 2, 8]", _copy_blocks(E4M3),
             exact=True),
        Case("convert_from_uint4", BF16, "[32, 16], 4 groups", _uint4(False), exact=True),
        Case("convert_from_uint4", BF16, "[32, 16], g_idx", _uint4(True), exact=True),
        Case("fp8_max", F32, "E4M3, E5M2", _fp8_max, exact=True),
        Case("cast_to_fp8_v2", E4M3, "[6, 10] per-row scale, amax", _cast_to_fp8("per row", E4M3),
             exact=True),
        Case("cast_to_fp8_v2", E5M2, "[6, 10] per-tensor scale, amax",
             _cast_to_fp8("tensor", E5M2), exact=True),
        Case("cast_from_fp8", F32, "[6, 10] per-column scale", _cast_from_fp8),
        Case("fp8_gemm_v2", BF16, "[5, 16] x [8, 16]^T, row and column scales, bias",
             _fp8_gemm(False)),
        Case("fp8_gemm_v2", BF16, "[5, 16] x [8, 16]^T + D (accumulate)", _fp8_gemm(True)),
        Case("lora_shrink", F32, "7 tokens, 3 slots, [32 -> 8]",
             lambda k, dev: _lora(k, dev, False)),
        Case("lora_expand", F32, "7 tokens, 3 slots, [8 -> 24]",
             lambda k, dev: _lora(k, dev, True)),
        Case("paged_decode", F32, "3 seqs, 4 q / 2 kv heads, block 4", _paged("plain")),
        Case("paged_decode", F32, "sinks, 3 seqs, block 4", _paged("sinks")),
        Case("paged_decode", F32, "FP8 cache, 3 seqs, block 4", _paged("fp8 cache")),
        Case("mla_prefill", F32, "4 heads, 6 tokens, rank 16 + rope 8", _mla_prefill),
        Case("mla_paged_decode", F32, "2 seqs, 4 heads, block 4", _mla_decode),
    ]  # fmt: skip


def generation(kernels: Any) -> str:
    """The Gaudi generation ("2", "3") the backend is, or plays."""
    from vllm_gaudi_platform import envs

    if kernels.IS_EMULATED:
        return (envs.get_raw(envs.VLLM_HPU_EMULATION_GAUDI) or "3").strip()
    found = re.search(r"GAUDI\s*(\d)", kernels.device_name().upper())
    return found.group(1) if found else "unknown"


def to_device(device: torch.device) -> Callable[[Any], Any]:
    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, (list, tuple)):
            return type(value)(move(v) for v in value)
        return value

    return move


def _compare(got: torch.Tensor, want: torch.Tensor, tol: dict[str, float]) -> tuple[bool, float]:
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        return False, math.inf
    error = (got - want).abs()
    finite = torch.isfinite(want) & torch.isfinite(got)
    same_special = (got == want) | (got.isnan() & want.isnan())
    worst = float(error[finite].max()) if bool(finite.any()) else 0.0
    ok = bool(((error <= tol["atol"] + tol["rtol"] * want.abs()) | same_special).all())
    return ok, worst


def run_cases(kernels: Any, reference: Any, gen: str) -> list[dict[str, Any]]:
    """Each case on `kernels` (inputs on its device) against `reference` (inputs on the host)."""
    device = kernels.torch_device(0)
    against_float64 = not hasattr(reference, "IS_EMULATED")
    results = []
    for case in cases():
        entry: dict[str, Any] = {
            "kernel": case.kernel,
            "dtype": str(case.dtype).removeprefix("torch."),
            "shape": case.shape,
            "generation": f"Gaudi {gen}",
            "reference": reference.NAME,
        }
        tol = case.tolerance(against_float64)
        entry["tolerance"] = tol
        try:
            want = case.run(reference, to_device(torch.device("cpu")))
            got = case.run(kernels, to_device(device))
            ok, worst = _compare(got, want, tol)
            entry.update(ok=ok, max_abs_error=worst)
            if not ok:
                entry["error"] = f"max abs error {worst:.3g} beyond atol {tol['atol']:g}"
        except Exception as exc:  # a kernel that raises disagrees too; the report says how
            entry.update(ok=False, max_abs_error=None, error=f"{type(exc).__name__}: {exc}")
        results.append(entry)
    covered = {c.kernel for c in cases()}
    for name in kernel_names():
        if name not in covered:
            results.append(
                {"kernel": name, "ok": False, "error": "no selftest case for this kernel"}
            )
    return results
