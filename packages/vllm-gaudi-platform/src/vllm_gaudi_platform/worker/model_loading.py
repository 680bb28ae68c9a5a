"""Model loading on the HPU runner: vLLM's loader, then what the platform adds before warmup.

After vLLM loads the weights: the state-layer check, LoRA's layer swap, the quantization
method's after-load hook (INC FP8), the drafter and its bucketing, the unquantized linears'
matmul routed to the seam, the vision-encoder shape tracking, the compiled model
(PT_HPU_LAZY_MODE=0), and whether packed prefill rows need HPU graphs of their own.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model

from vllm_gaudi_platform import envs, quant_hooks
from vllm_gaudi_platform.attention import chunked_local
from vllm_gaudi_platform.worker import compiled, hpu_graphs, hybrid, spec_decode, vision
from vllm_gaudi_platform.worker.compiled import compile_wanted

logger = init_logger(f"vllm.{__name__}")


def load(runner: Any, model: torch.nn.Module | None) -> None:
    """Load the model into `runner` (or take `model`, already loaded, as vLLM's runner does)."""
    logger.info("Loading model %s on %s", runner.model_config.model, runner.seam.NAME)
    # Any: vLLM's model classes add methods (compute_logits, ...) that nn.Module lacks.
    loaded: Any = model if model is not None else get_model(vllm_config=runner.vllm_config)
    hybrid.check_state_layers(loaded)
    # Chunked local attention as masks over the step's layout (attention/chunked_local.py).
    chunked_local.use_hpu_chunking(loaded)
    runner.model = loaded
    if runner.lora_config:
        # vLLM's LoRA manager swaps the supported layers for LoRA layers whose products run
        # through the platform's punica wrapper (worker/lora.py, PunicaWrapperHPU).
        runner.model = runner.load_lora_model(runner.model, runner.vllm_config, runner.device)
    # A quantization method may transform the loaded model before warmup (INC FP8 patches its
    # layers for measurement or FP8). The hook is declared in quant_hooks.py: the platform never
    # imports a quant wheel.
    quant_config = runner.vllm_config.quant_config
    if isinstance(quant_config, quant_hooks.TransformsLoadedModel):
        runner.model = quant_config.hpu_after_load_model(runner.model)
    if hasattr(runner, "drafter"):
        runner.drafter.load_model(runner.model)
        if runner.use_aux_hidden_state_outputs:
            # EAGLE-3: the target also returns the hidden states of the layers the head reads
            # (vLLM's constructor set the flag; its load_model tells the model which layers).
            runner._setup_eagle3_aux_hidden_state_outputs()
        runner.draft_bucketing = spec_decode.draft_bucketing(runner)
    runner.linears_on_seam = route_linears_through_seam(runner)
    vision.track_encoder(runner)  # vision-encoder shapes counted like the buckets'
    # torch.compile (eager mode, PT_HPU_LAZY_MODE=0): the forward pass compiled per bucket.
    runner.compiled_model = None
    # Diagnostics (the worker's set_compiled_forward): False runs the passes op by op.
    runner.compiled_forward_on = True
    if compile_wanted(runner.vllm_config):
        runner.compiled_model = compiled.CompiledModel(
            runner.model,
            runner.seam.COMPILE_BACKEND,
            strict=envs.get_bool(envs.VLLM_FULL_WARMUP),
            publish=runner.step_metrics.set_compile,
        )
        if runner.draft_bucketing is not None:  # the draft head too, in the same stats
            runner.draft_bucketing.compile(runner.compiled_model, runner.seam.COMPILE_BACKEND)
    # HPU graphs: whether a packed prefill row needs a graph of its own at every bucket.
    layers = runner.vllm_config.compilation_config.static_forward_context.values()
    runner.graphs.packing_matters = hpu_graphs.packing_matters(layers)
    runner.recompiles.distinct_packed = runner.graphs.needs_packed_variant


def route_linears_through_seam(runner: Any) -> int:
    """Send the unquantized linear layers' matmul (vLLM's UnquantizedLinearMethod, which
    calls F.linear off CUDA and CPU) to the seam's `linear`, in the model and the drafter.
    Quantized layers keep their method's kernels. Returns the number of layers routed."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    linear = runner.seam.linear

    def gemm(
        layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return linear(x, weight, bias)

    models = [runner.model, getattr(getattr(runner, "drafter", None), "model", None)]
    routed = 0
    for model in (m for m in models if isinstance(m, torch.nn.Module)):
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and type(method) is UnquantizedLinearMethod:
                method._gemm_impl = gemm
                routed += 1
    logger.debug("%d unquantized linear layers run through the seam's linear", routed)
    return routed
