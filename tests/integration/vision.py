"""The vision-language cases the engine tests share: prompts with images, transformers' greedy
reference for them, and the chat messages that carry the same prompts to a server.

A case is a list of message parts: a string is text, a (height, width) pair an image of that size
(seeded random pixels, `tinyvision.images`, the seed being the case's `seed`). The processor's
chat template turns the parts into the prompt text, with the model's image placeholder where an
image is; vLLM and transformers then run the same processor on it.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

from gaudi_testkit import tinymodels, tinyvision
from tests.integration.generation import greedy_generate

MAX_TOKENS = 12


def _long_text(words: int) -> str:
    corpus = tinymodels.CORPUS.split()
    return " ".join(corpus[i % len(corpus)] for i in range(words))


@dataclass(frozen=True)
class Case:
    parts: tuple[Any, ...]
    seed: int = 0

    def images(self) -> list[Any]:
        sizes = [p for p in self.parts if isinstance(p, tuple)]
        return tinyvision.images(sizes, seed=self.seed)

    def messages(self, image_part: Any = None) -> list[dict]:
        """One user message; each image becomes `image_part(picture)` (default: the bare
        {"type": "image"} part that transformers' chat template reads)."""
        content = []
        pictures = iter(self.images())
        for part in self.parts:
            if isinstance(part, tuple):
                picture = next(pictures)
                content.append(image_part(picture) if image_part else {"type": "image"})
            else:
                content.append({"type": "text", "text": part})
        return [{"role": "user", "content": content}]


# Sizes in pixels; Qwen2.5-VL takes 28x28 pixels per language token (so 4 to 64 tokens here).
CASES: dict[str, Case] = {
    "square": Case(((56, 56), "describe the fox")),
    "wide": Case(("what is in the picture?", (84, 112), "The quick brown")),
    "tall": Case(((112, 56), "Hello world")),
    "large": Case(((224, 224), "Numbers like 1, 2, 3")),
    "two images": Case(((56, 84), "and", (84, 56), "which one is sunny?")),
    # Text of about 250 tokens before the image: with 256 tokens per step, the prompt's prefill
    # is chunked across the image's placeholder tokens.
    "chunked": Case((_long_text(160), (112, 112), "the river")),
    # "square"'s text and image size with other pixels: the same prompt token ids, so only the
    # image's hash keeps the prefix cache from serving "square"'s blocks for it.
    "square, other pixels": Case(((56, 56), "describe the fox"), seed=1),
}


def prompt_text(processor: Any, case: Case) -> str:
    return processor.apply_chat_template(
        case.messages(), add_generation_prompt=True, tokenize=False
    )


def hf_greedy(model: str, names: list[str], *, causal: bool = False) -> dict[str, dict]:
    """transformers' greedy continuation (tokens, top-5 logprobs) of each case, one at a time.
    `causal`: without the processor's `token_type_ids`, by which Gemma 3 attends within each
    image both ways (its language model is then causal throughout)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    hf = AutoModelForImageTextToText.from_pretrained(model, torch_dtype=torch.float32).eval()
    results = {}
    with torch.no_grad():
        for name in names:
            case = CASES[name]
            inputs = processor(
                text=[prompt_text(processor, case)], images=case.images(), return_tensors="pt"
            )
            if causal:
                inputs.pop("token_type_ids", None)
            results[name] = greedy_generate(hf, MAX_TOKENS, **inputs)
    return results


def data_url(picture: Any) -> str:
    """The picture as a base64 PNG data URL (lossless: the server decodes the same pixels)."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_messages(case: Case) -> list[dict]:
    """The case as OpenAI chat messages, each image an `image_url` part with a data URL."""
    return case.messages(lambda p: {"type": "image_url", "image_url": {"url": data_url(p)}})
