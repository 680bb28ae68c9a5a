"""Tiny vision-language models built locally, for the tests: no model hub needed.

Each is a real Hugging Face architecture (vision tower, projector, language model) with seeded
random weights, saved with its processor (image processor, the tiny BPE tokenizer of
`tinymodels` with the model's placeholder tokens, a chat template that places an image where a
message part says so), once under the tiny-model cache folder and reused.

Images for the tests come from `images()`: seeded random RGB pictures of the sizes asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from gaudi_testkit import tinymodels

# A chat template whose messages hold a string or a list of parts ({"type": "text", "text": ..}
# or {"type": "image"}, as vLLM's chat handling passes them), with the image placeholder in
# `{image}`.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}{image}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

# The language model: tinymodels' text config (its dtype is the checkpoint's, set at save).
_TEXT = {k: v for k, v in tinymodels.BASE_CONFIG.items() if k != "torch_dtype"}

QWEN_SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# name -> what the builder needs. Qwen2.5-VL: a 2-block vision tower (block 0 attends within
# 2x2-token windows of 56 pixels, block 1 globally, as Qwen's fullatt_block_indexes say), 14-pixel
# patches merged 2x2 into one language token (so 28x28 pixels per token), M-RoPE over t/h/w
# sections of the 16 rotary pairs. The image processor keeps images between 4 and 64 tokens.
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl": {
        "text": {
            **_TEXT,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
            },
        },
        "vision": {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 128,
            "fullatt_block_indexes": [1],
            "window_size": 56,
            "initializer_range": 0.25,
        },
        "pixels": (28 * 28 * 4, 28 * 28 * 64),
    },
}


LLAVA_SPECIAL = ("<image>",)

# Llava-style: a CLIP vision tower (2 layers; the features of the second to last, CLS token
# dropped, as Llava 1.5 reads them), a 2-layer GELU projector, and a Llama. Every image is resized
# and center-cropped to 56x56 pixels: 4x4 patches of 14, so 16 language tokens per image.
MODELS["llava"] = {
    "text": {**_TEXT, "model_type": "llama"},
    "vision": {
        "model_type": "clip_vision_model",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "projection_dim": 64,
        "initializer_range": 0.25,
    },
    "pixels": 56,
}


GEMMA3_SPECIAL = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}

# Gemma 3 with its vision tower: SigLIP (2 layers, 56x56 pixels in 14-pixel patches, so a 4x4
# grid), average-pooled to 16 soft tokens per image between <start_of_image> and <end_of_image>,
# then tinymodels' Gemma 3 text model (two sliding layers, one global). Every image is resized to
# 56x56 (no pan-and-scan). vLLM serves it as an "mm prefix LM": the language model's attention is
# bidirectional among the soft tokens of one image (transformers: `token_type_ids`), which the
# window of 64 keeps in reach on the sliding layers. Its projection weight starts at zero in
# transformers; it is drawn here (std 1), so the pictures move the output.
MODELS["gemma3"] = {
    "text": {**_TEXT, **tinymodels.MODELS["gemma3"][1], "sliding_window": 64},
    "vision": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "vision_use_head": False,
    },
    "tokens_per_image": 16,
    "projection_std": 1.0,
    "newline_tokens": 4,
}


def build(name: str = "qwen2.5-vl", *, seed: int = 0, root: Path | None = None) -> Path:
    """Path of the tiny vision-language model `name`, building and caching it on first use."""
    if name not in MODELS:
        raise ValueError(f"Unknown tiny vision model {name!r}; choose one of {sorted(MODELS)}.")
    spec = MODELS[name]
    recipe = [name, spec, seed, tinymodels.CORPUS, _CHAT_TEMPLATE]
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    path = (root or tinymodels.cache_root()) / f"tiny-{name}-{key}"
    if (path / "config.json").exists() and (path / "processor_config.json").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    builders = {"qwen2.5-vl": _build_qwen2_5_vl, "llava": _build_llava, "gemma3": _build_gemma3}
    builder = builders[name]
    builder(tmp, spec, seed)
    with contextlib.suppress(OSError):  # another process built it first
        tmp.rename(path)
    return path


def _save_model(path: Path, model_class: Any, config: Any, seed: int, draw: Any = None) -> Any:
    """The model built with seeded random weights (`draw(model)` then changes some), in float32,
    saved to `path`."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    if draw is not None:
        with torch.no_grad():
            draw(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _save_tokenizer(path: Path, tokenizer: Any, placeholder: str) -> str:
    """Save the tokenizer with the chat template that writes `placeholder` for an image;
    returns the template (the processor takes it too)."""
    template = _CHAT_TEMPLATE.replace("{image}", placeholder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return template


def _build_qwen2_5_vl(path: Path, spec: dict[str, Any], seed: int) -> None:
    import transformers

    tokenizer = tinymodels._build_tokenizer(path, QWEN_SPECIAL)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL}
    config = transformers.Qwen2_5_VLConfig(
        text_config=spec["text"],
        vision_config=spec["vision"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    _save_model(path, transformers.Qwen2_5_VLForConditionalGeneration, config, seed)
    template = _save_tokenizer(path, tokenizer, "<|vision_start|><|image_pad|><|vision_end|>")
    low, high = spec["pixels"]
    processor = transformers.Qwen2_5_VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(min_pixels=low, max_pixels=high),
        video_processor=transformers.Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=template,
    )
    processor.save_pretrained(path)


def _build_llava(path: Path, spec: dict[str, Any], seed: int) -> None:
    import transformers

    tokenizer = tinymodels._build_tokenizer(path, LLAVA_SPECIAL)
    side, patch = spec["pixels"], spec["vision"]["patch_size"]
    config = transformers.LlavaConfig(
        vision_config=spec["vision"],
        text_config=spec["text"],
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=(side // patch) ** 2,
        tie_word_embeddings=False,
    )
    _save_model(path, transformers.LlavaForConditionalGeneration, config, seed)
    _hub_tower_names(path)
    template = _save_tokenizer(path, tokenizer, "<image>")
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        ),
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, which "default" drops
        chat_template=template,
        image_token="<image>",
    )
    processor.save_pretrained(path)


def _hub_tower_names(path: Path) -> None:
    """The hub's Llava and Gemma 3 checkpoints name the tower's weights
    `vision_tower.vision_model.*` (a CLIP or SigLIP vision model), which is what vLLM's loaders
    map; transformers 5 saves them one level up. Rewritten to the hub's names, which transformers
    reads back as well."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    renamed = {
        name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
        for name, tensor in weights.items()
    }
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})


def _build_gemma3(path: Path, spec: dict[str, Any], seed: int) -> None:
    import transformers

    # vLLM's Gemma 3 processing merges the newlines around an image the way Gemma's own
    # vocabulary does: runs of one to four newlines are single tokens there, and here.
    newlines = tuple("\n" * n for n in range(1, spec["newline_tokens"] + 1))
    tokenizer = tinymodels._build_tokenizer(
        path, (*GEMMA3_SPECIAL.values(), *newlines), named=GEMMA3_SPECIAL
    )
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in GEMMA3_SPECIAL.items()}
    config = transformers.Gemma3Config(
        text_config=spec["text"],
        vision_config=spec["vision"],
        mm_tokens_per_image=spec["tokens_per_image"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        initializer_range=_TEXT["initializer_range"],
        tie_word_embeddings=False,
    )
    _save_model(
        path,
        transformers.Gemma3ForConditionalGeneration,
        config,
        seed,
        lambda model: model.model.multi_modal_projector.mm_input_projection_weight.normal_(
            0.0, spec["projection_std"]
        ),
    )
    _hub_tower_names(path)
    # The processor expands each <start_of_image> into the image's soft tokens.
    template = _save_tokenizer(path, tokenizer, GEMMA3_SPECIAL["boi_token"])
    side = spec["vision"]["image_size"]
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(size={"height": side, "width": side}),
        tokenizer=tokenizer,
        chat_template=template,
        image_seq_length=spec["tokens_per_image"],
    )
    processor.save_pretrained(path)


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Any]:
    """Seeded random RGB pictures (PIL images), one per (height, width)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
