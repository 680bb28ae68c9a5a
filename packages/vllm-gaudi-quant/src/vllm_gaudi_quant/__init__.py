"""Gaudi quantization methods for vLLM, one `vllm.general_plugins` entry point per method.

Layout (follow it when adding a method `<method>`):

- `vllm_gaudi_quant/register.py`: the entry points. One line in `METHODS` per method (the name
  vLLM knows it by, its config class, the optional package it needs) makes
  `vllm_gaudi_quant.register.<method>` a register function decorated with
  `vllm_gaudi_platform.plugins.general_plugin("hpu_quant_<method>")`: idempotent, a no-op off HPU,
  registering only its own name (so correct in any order against the other methods), importing
  nothing heavy until it runs.
- `vllm_gaudi_quant/methods/<method>.py`: the heavy code (config class, linear and MoE methods),
  importing torch and vllm freely. Kernels come from `vllm_gaudi_platform.seam.backend()`.
- `pyproject.toml`: `hpu_quant_<method> = "vllm_gaudi_quant.register:<method>"` under
  `[project.entry-points."vllm.general_plugins"]`.
- `tests/quant/`: tests run against this wheel and the platform wheel only (never import
  `vllm_gaudi_ops`); `tests/quant/conftest.py` has the shared fixtures.
- `benchmarks/quant.py`: add a row to its METHODS table.

Shared pieces: `methods/fp8.py` exposes `apply_fp8_linear` (FP8 weight [K, N] times activations
quantized with `cast_to_fp8_v2`, through `fp8_gemm_v2`; defined in `methods/fp8_linear.py`) and
`HpuFp8MoEMethod` (FP8 experts; defined in `methods/fp8_moe.py`) for any method with FP8 weights.
`methods/uint4.py` holds the 4-bit pieces: the repacking helpers, `Uint4LinearMethod` and
`Uint4MoEMethod` (a new 4-bit format only creates its checkpoint's parameters and repacks them
into `convert_from_uint4`'s layout), and `Uint4Config` (name and claiming of a checkpoint format).
"""
