"""habana_frameworks.torch: importing it registers the Gaudi ops (`torch.ops.hpu.*`) and the
dynamo backend `hpu_backend`, as Habana's package does on import.

The ops are torch custom ops (with fake implementations, so torch.compile can trace them) whose
CPU implementations are `_kernels.py`. Registration is once per process: the test fixtures keep
these module objects alive between the tests that use them.
"""

from __future__ import annotations

import torch

from habana_frameworks.torch import _kernels, _torch_device

_OPS = (
    "cast_to_fp8_v2",
    "cast_from_fp8",
    "fp8_gemm_v2",
    "convert_from_uint4",
    "mixture_of_experts",
)


def _fake_cast_to_fp8_v2(input, scale=None, stochastic_rounding=False, is_amax=False, dtype=None):
    amax = input.new_empty((), dtype=torch.float32) if is_amax else input.new_empty(0)
    return input.new_empty(input.shape, dtype=dtype), amax


def _fake_cast_from_fp8(input, scale, out_dtype):
    return input.new_empty(input.shape, dtype=out_dtype)


def _fake_fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype, *args, **kwargs):
    m = A.shape[-1] if trans_A else A.shape[-2]
    n = B.shape[-2] if trans_B else B.shape[-1]
    return A.new_empty((*A.shape[:-2], m, n), dtype=out_dtype)


def _fake_convert_from_uint4(input, scale, zero_point, out_dtype, g_idx=None):
    return input.new_empty((input.shape[0], scale.shape[1]), dtype=out_dtype)


def _fake_mixture_of_experts(hidden_states, *args, **kwargs):
    return torch.empty_like(hidden_states)


def _fake_mixture_of_experts_fp8(hidden_states, expert_routing_table, router_weights, *args):
    # The FP8 form returns the model's dtype (router weights').
    return hidden_states.new_empty(hidden_states.shape, dtype=router_weights.dtype)


_FAKES = {
    "cast_to_fp8_v2": _fake_cast_to_fp8_v2,
    "cast_from_fp8": _fake_cast_from_fp8,
    "fp8_gemm_v2": _fake_fp8_gemm_v2,
    "convert_from_uint4": _fake_convert_from_uint4,
    "mixture_of_experts": _fake_mixture_of_experts,
}


def _register() -> None:
    for name in _OPS:
        if hasattr(torch.ops.hpu, name):
            continue
        op = torch.library.custom_op(f"hpu::{name}", mutates_args=())(getattr(_kernels, name))
        op.register_fake(_FAKES[name])
    # The FP8 form of mixture_of_experts is an overload of the same op, as in Habana's bridge:
    # torch.ops.hpu.mixture_of_experts(...) picks it when the call passes its scale arguments.
    if "fp8_fused_weights" not in torch.ops.hpu.mixture_of_experts.overloads():
        qualname = "hpu::mixture_of_experts.fp8_fused_weights"
        torch.library.define(qualname, _kernels.MOE_FP8_SCHEMA)
        torch.library.impl(qualname, "CompositeExplicitAutograd")(_kernels.mixture_of_experts_fp8)
        torch.library.register_fake(qualname)(_fake_mixture_of_experts_fp8)
    if "bias_mxfp4_fused_weights" not in torch.ops.hpu.mixture_of_experts.overloads():
        qualname = "hpu::mixture_of_experts.bias_mxfp4_fused_weights"
        torch.library.define(qualname, _kernels.MOE_MXFP4_SCHEMA)
        torch.library.impl(qualname, "CompositeExplicitAutograd")(_kernels.mixture_of_experts_mxfp4)
        torch.library.register_fake(qualname)(_fake_mixture_of_experts)


def _fake_cast_to_fp8_v2_scalar(
    input, scale, stochastic_rounding=False, is_amax=False, dtype=None, scale_shape=None
):
    return _fake_cast_to_fp8_v2(input, None, stochastic_rounding, is_amax, dtype)


def _fake_cast_from_fp8_scalar(input, scale, out_dtype, scale_shape=None):
    return _fake_cast_from_fp8(input, None, out_dtype)


def _fake_fp8_gemm_v2_scalar(A, trans_A, B, trans_B, D, out_dtype, *args, **kwargs):
    return _fake_fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype)


_SCALAR_FAKES = {
    "cast_to_fp8_v2": _fake_cast_to_fp8_v2_scalar,
    "cast_from_fp8": _fake_cast_from_fp8_scalar,
    "fp8_gemm_v2": _fake_fp8_gemm_v2_scalar,
}


def _register_scalar_overloads() -> None:
    for name, schema in _kernels.SCALAR_SCHEMAS.items():
        if "scalar" in getattr(torch.ops.hpu, name).overloads():
            continue
        qualname = f"hpu::{name}.scalar"
        torch.library.define(qualname, schema)
        torch.library.impl(qualname, "CompositeExplicitAutograd")(
            getattr(_kernels, f"{name}_scalar")
        )
        torch.library.register_fake(qualname)(_SCALAR_FAKES[name])


def _register_dynamo_backend() -> None:
    # Fact: importing habana_frameworks.torch registers the torch.compile backend "hpu_backend"
    # (an AOT-autograd backend compiling the FX graph for the Gaudi graph compiler). The
    # stand-in's runs the traced graph on the CPU through aot_eager's path, and marks the time
    # a compiled graph runs (ops blocklisted in the eager frontend are legal there).
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends.debugging import aot_eager

    def hpu_backend(gm, example_inputs, **kwargs):
        compiled = aot_eager(gm, example_inputs, **kwargs)

        def run(*args):
            _kernels.IN_COMPILED_GRAPH[0] += 1
            try:
                return compiled(*args)
            finally:
                _kernels.IN_COMPILED_GRAPH[0] -= 1

        return run

    if "hpu_backend" not in list_backends(exclude_tags=()):
        register_backend(name="hpu_backend")(hpu_backend)


_register()
_register_scalar_overloads()
_register_dynamo_backend()
if _torch_device.requested():
    _torch_device.install()

# Fact: importing Habana's package registers the collectives backend "hccl" (Intel's worker
# imports nothing else before initializing torch.distributed with it).
from habana_frameworks.torch.distributed import hccl as _hccl  # noqa: E402, F401
