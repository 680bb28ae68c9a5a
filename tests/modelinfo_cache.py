"""Fills vLLM's model-info cache once, in one process, before the engine tests start.

The first time vLLM meets an architecture it inspects the model class in a fresh interpreter
(`python -m vllm.model_executor.models.registry`: 20-40 s of CPU on a 2-core machine, vLLM and
torch imported again) and keeps the answer in `$VLLM_CACHE_ROOT/modelinfos`, keyed by the model
module's hash. On a clean machine the suite's engines met some 25 architectures that way, one
interpreter each. This script does the same inspection for every architecture in vLLM's registry
in ONE process (about 55 s of CPU for all 319 of vLLM 0.32's; the suite's own, SUITE, first),
with the same platform and plugins as the engine jobs (the HPU platform in emulation), and
writes the same cache files through vLLM's own code; an engine then reads them as it would on a
machine that served those models before. An architecture whose module does not import here is
left to vLLM (which inspects it as usual, or fails as usual).

    python -m tests.modelinfo_cache        # prints how many it inspected and how long it took

`tests/conftest.py` starts it in the background when a session runs engine tests.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

# The model classes the suite's engines load (vLLM module, class), as a clean run's cache held
# them; inspected first, so that the engines that start at once find theirs.
SUITE = {
    ("bert", "BertEmbeddingModel"),
    ("bloom", "BloomForCausalLM"),
    ("deepseek_v2", "DeepseekV2ForCausalLM"),
    ("falcon_h1", "FalconH1ForCausalLM"),
    ("gemma", "GemmaForCausalLM"),
    ("gemma2", "Gemma2ForCausalLM"),
    ("gemma3", "Gemma3ForCausalLM"),
    ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    ("gpt_oss", "GptOssForCausalLM"),
    ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    ("llama", "LlamaForCausalLM"),
    ("llama_eagle", "EagleLlamaForCausalLM"),
    ("llama_eagle3", "Eagle3LlamaForCausalLM"),
    ("llava", "LlavaForConditionalGeneration"),
    ("mimo", "MiMoForCausalLM"),
    ("mimo_mtp", "MiMoMTP"),
    ("mistral", "MistralForCausalLM"),
    ("mixtral", "MixtralForCausalLM"),
    ("nemotron_h", "NemotronHForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    ("qwen2_rm", "Qwen2ForRewardModel"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("qwen3_next", "Qwen3NextForCausalLM"),
    ("transformers", "TransformersForSequenceClassification"),
}


def _suite_first(item: tuple[str, object]) -> bool:
    model = item[1]
    key = (getattr(model, "module_name", "").rpartition(".")[2], getattr(model, "class_name", ""))
    return key not in SUITE


def main() -> int:
    start = time.perf_counter()
    from vllm.model_executor.models import registry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as vLLM's own inspection process does
    inspected = cached = failed = 0
    for name, model in sorted(registry.ModelRegistry.models.items(), key=_suite_first):
        if not isinstance(model, registry._LazyRegisteredModel):
            continue
        try:
            spec = importlib.util.find_spec(model.module_name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin or not os.path.exists(spec.origin):
            continue
        module_hash = model._get_modelinfo_module_hash(registry.Path(spec.origin))
        if model._load_modelinfo_from_cache(module_hash) is not None:
            cached += 1
            continue
        try:
            info = registry._ModelInfo.from_model_cls(model.load_model_cls())
        except Exception as exc:  # vLLM inspects it itself later, or reports why it cannot
            failed += 1
            print(f"{name}: not inspected here ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        model._save_modelinfo_to_cache(info, module_hash)
        inspected += 1
    print(
        f"model infos: {inspected} inspected, {cached} already cached, {failed} left to vLLM, "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
