"""The checks `HpuPlatform.check_and_update_config` runs on vLLM's config before any engine
starts: settings the HPU does not honour are refused with the setting's name and the fix, and
the few it adjusts (async scheduling, whole images per prefill chunk) are logged."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from vllm_gaudi_platform import envs

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

logger = init_logger(f"vllm.{__name__}")


def float16_runs_in_bfloat16(model_config: ModelConfig) -> bool:
    """Whether the model would compute in float16 but for Gaudi: an explicit dtype="float16"
    (still float16 here), or dtype="auto" on a float16 checkpoint, which vLLM already resolved
    to bfloat16 (the first type of `supported_dtypes`), with its own generic warnings only. An
    explicit "bfloat16" on a float16 checkpoint looks the same here and gets the warning too."""
    if model_config.dtype == torch.float16:
        return True
    text_config = model_config.hf_text_config
    checkpoint = getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None)
    return model_config.dtype == torch.bfloat16 and checkpoint in (torch.float16, "float16")


def whole_images_for_mm_prefix(vllm_config: VllmConfig) -> None:
    """Models whose images attend among their own tokens both ways (Gemma 3: vLLM's "mm prefix
    LMs") need each image's tokens in one prefill chunk: every one of them sees the last. The
    scheduler then never splits an image (`disable_chunked_mm_input`), as vLLM's CUDA platform
    sets too."""
    model_config, scheduler_config = vllm_config.model_config, vllm_config.scheduler_config
    if (
        model_config is not None
        and model_config.is_mm_prefix_lm
        and scheduler_config.is_multimodal_model
        and not scheduler_config.disable_chunked_mm_input
    ):
        logger.info(
            "%s attends within each image both ways: an image's tokens are prefilled in one "
            "chunk (disable_chunked_mm_input).",
            model_config.model,
        )
        scheduler_config.disable_chunked_mm_input = True


def check_async_scheduling(vllm_config: VllmConfig) -> None:
    """Keep vLLM's choice of async scheduling (on by default since vLLM resolves `None` to on),
    except for configurations the HPU runner does not run with it, which get it off and a log
    line saying why.

    With async scheduling the engine schedules step N+1 and the runner prepares its inputs
    (metadata, bucket padding) while step N runs on the device; step N's sampled tokens stay on
    the device and are scattered into step N+1's input ids there. On a Gaudi in lazy mode the
    forward returns before the device finishes, so that host work is hidden. In CPU emulation
    every op finishes before it returns: nothing overlaps, and what CI checks is that the code
    path (placeholder tokens, device-side input ids, the deferred output copy) gives the same
    outputs as synchronous scheduling.
    """
    scheduler_config = vllm_config.scheduler_config
    if not scheduler_config.async_scheduling:
        return
    reason = None
    model_config = vllm_config.model_config
    if vllm_config.speculative_config is not None:
        # vLLM itself turns it off (or refuses an explicit request) for the n-gram drafter. EAGLE
        # heads stay synchronous on HPU as well: their drafting passes are planned on the host
        # from the exact sequence lengths of the step (spec_decode.DraftBucketing).
        reason = (
            "speculative decoding: the n-gram drafter reads the sampled tokens on the host, "
            "which async scheduling leaves on the device, and EAGLE drafting plans its buckets "
            "from the step's sequence lengths on the host"
        )
    elif model_config is not None and model_config.runner_type == "pooling":
        reason = "pooling models: a pooling step samples no token for the next step to overlap"
    if reason is not None:
        logger.info("Async scheduling is off on HPU for %s.", reason)
        scheduler_config.async_scheduling = False


def check_bucketing(vllm_config: VllmConfig) -> None:
    """Build the bucket plan once here, in the process that parses the config, so a bad
    VLLM_*_BUCKET_* setting stops startup with the variable's name before workers spawn."""
    from vllm_gaudi_platform.bucketing import plan_from_env

    sched = vllm_config.scheduler_config
    model_config = vllm_config.model_config
    if model_config is None:
        return
    plan_from_env(
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=model_config.max_model_len,
        block_size=vllm_config.cache_config.block_size,
    )
    for name in (envs.VLLM_SKIP_WARMUP, envs.VLLM_FULL_WARMUP):
        envs.get_bool(name)
    envs.get_number(envs.VLLM_GRAPH_RESERVED_MEM, lo=0.0, hi=1.0)
    # A selftest report that cannot be read stops startup here too, whatever the model.
    from vllm_gaudi_platform import selftest_defaults

    selftest_defaults.report_decisions()


def check_compile_settings(vllm_config: VllmConfig) -> None:
    """Refuse, before any engine starts, a compile setting this platform would not honour."""
    import torch._dynamo
    from vllm.config import CompilationMode

    from vllm_gaudi_platform.worker.compiled import compile_wanted

    mode = vllm_config.compilation_config.mode
    if mode in (CompilationMode.STOCK_TORCH_COMPILE, CompilationMode.DYNAMO_TRACE_ONCE):
        raise ValueError(
            f"compilation mode {mode.name} is not supported on HPU: with PT_HPU_LAZY_MODE=0 the "
            "platform compiles every bucket with torch.compile itself, and with "
            "PT_HPU_LAZY_MODE=1 it replays HPU graphs; leave the compilation mode unset (or "
            "pass enforce_eager=True to compile nothing)."
        )
    # torch.compile returns the function untouched under TORCHDYNAMO_DISABLE=1; dynamo's config
    # flag stops compiled frames from running.
    dynamo_off = torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1"
    if compile_wanted(vllm_config) and dynamo_off:
        raise ValueError(
            "PT_HPU_LAZY_MODE=0 runs steps through torch.compile, which TORCHDYNAMO_DISABLE=1 "
            "turns off: unset TORCHDYNAMO_DISABLE, set PT_HPU_LAZY_MODE=1 for HPU graphs, or "
            "pass enforce_eager=True."
        )


# vLLM's KV offloading to host memory: `kv_offloading_size` (`--kv-offloading-size`, "native"
# backend), from which vLLM makes an OffloadingConnector config after the platform's check
# (VllmConfig._post_init_kv_transfer_config), or an OffloadingConnector named in
# `kv_transfer_config`. vLLM's own specs refuse every device but CUDA and XPU; on the HPU each
# is the connectors wheel's counterpart (same settings).
OFFLOADING_SPECS = {
    "CPUOffloadingSpec": "HpuCPUOffloadingSpec",
    "TieringOffloadingSpec": "HpuTieringOffloadingSpec",
}


def hpu_offloading_specs(vllm_config: VllmConfig) -> None:
    """Point vLLM's KV offloading (its flag, or its connector with one of its own specs) at the
    HPU's specs, refusing where they are not installed."""
    cache_config = vllm_config.cache_config
    flag = cache_config.kv_offloading_size is not None
    if flag and cache_config.kv_offloading_backend != "native":
        return
    transfer = vllm_config.kv_transfer_config
    if not flag and (transfer is None or transfer.kv_connector != "OffloadingConnector"):
        return
    import vllm.envs as vllm_envs

    if flag and vllm_envs.VLLM_USE_SIMPLE_KV_OFFLOAD:
        raise ValueError(
            "VLLM_USE_SIMPLE_KV_OFFLOAD=1 picks vLLM's SimpleCPUOffloadConnector, which does not "
            "run on the HPU: unset it, and kv_offloading_size offloads through "
            "HpuCPUOffloadingSpec (vllm-gaudi-connectors)."
        )
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if transfer is None:
        transfer = vllm_config.kv_transfer_config = KVTransferConfig()
    extra = transfer.kv_connector_extra_config
    requested = extra.get("spec_name", "CPUOffloadingSpec")
    spec = OFFLOADING_SPECS.get(requested)
    if spec is None:  # a spec of the connectors wheel, or another plugin's: as named
        return
    if spec not in OffloadingSpecFactory._registry:
        setting = f"kv_offloading_size={cache_config.kv_offloading_size}" if flag else requested
        raise ValueError(
            f"{setting}: KV offloading on the HPU runs through {spec}, which the hpu_offload "
            "plugin registers: pip install vllm-gaudi-connectors, and keep hpu_offload in "
            "VLLM_PLUGINS if it is set."
        )
    logger.info("KV offloading: %s runs as %s on the HPU.", requested, spec)
    extra["spec_name"] = spec
