"""neural-compressor's patched-module table, extended with vLLM's linear classes (emulation's INC
path)."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "neural_compressor.torch.algorithms.fp8_quant:register_patched_module",
        "inc.register_vllm_linears puts vLLM's linear classes in the CPU patched-module table",
        params=("supported_float_module_types",),
        keywords=("device_types",),
    ),
    *(
        Upstream(
            f"neural_compressor.torch.algorithms.fp8_quant._quant_common.helper_modules:{name}",
            "inc.register_vllm_linears subclasses it for vLLM's linear classes",
        )
        for name in (
            "PatchedColumnParallelLinear",
            "PatchedRowParallelLinear",
            "PatchedReplicatedLinear",
        )
    ),
    Upstream(
        "neural_compressor.torch.algorithms.fp8_quant.model_configs:ModuleType",
        "inc.register_vllm_linears types its wrappers as linear modules",
    ),
)

PATCH = Patch(
    what=(
        "vLLM's five parallel linear classes registered with neural-compressor's "
        '`register_patched_module(cls, device_types="cpu")` as its vLLM-aware wrappers typed as '
        "plain linear layers; process-wide in neural-compressor, once per process."
    ),
    why=(
        "neural-compressor's CPU path only patches modules it knows by class name; on a Gaudi "
        "it registers these classes itself."
    ),
    can_go="when neural-compressor's CPU table lists vLLM's linear classes.",
    sites=("vllm_gaudi_quant.methods.inc:register_vllm_linears",),
    scope="process",
    upstream=UPSTREAM,
)
