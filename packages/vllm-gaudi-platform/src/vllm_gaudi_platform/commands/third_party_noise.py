"""Third-party start-up messages kept off the screens of `vllm-gaudi demo` and `doctor`.

On the CPU engine, before any line of ours, a newcomer would read: torchao failing to load its
CUDA extensions (transformers imports torchao because neural-compressor needs it installed),
torch's deprecation notes about the Enum types torchao registers, vLLM saying its Triton has no
CPU backend, and FutureWarnings about `torch.distributed.reduce_op` from vLLM's Triton dispatcher.
None of them says anything about this machine that the operator can act on.

`silence()` drops exactly those messages, each matched by its logger (or warning category) AND
its text, so any other message of the same library, and every message of ours, still shows. It is
called at the `vllm-gaudi` command's import: vLLM's engine and worker processes are spawned, and
a spawned child runs the parent's main script again before anything else, so the filters are in
place in every process of the command. `vllm serve` is vLLM's own command and is left alone.
"""

from __future__ import annotations

import logging
import re
import warnings

# (logger name, message pattern) of each silenced log message.
LOG_MESSAGES: tuple[tuple[str, str], ...] = (
    # torchao's prebuilt CUDA extensions, which cannot load against the CPU torch.
    ("torchao", r"^Failed to load .*torchao/_C\w*\..*\.so"),
    # torchao registers Enum types with torch's pytree; torch 2.13 calls that deprecated.
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported"),
    # vLLM's CPU build with PyPI's Triton, which has no CPU backend (nothing here uses Triton).
    ("vllm.triton_utils.importing", r"doesn't include CPU backend"),
)
# (category, message pattern) of each silenced warning.
WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # vLLM's Triton dispatcher walks every module's attributes, touching torch's deprecated alias.
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),
)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence() -> None:
    """Install the filters in this process (idempotent)."""
    for name, pattern in LOG_MESSAGES:
        logger = logging.getLogger(name)
        if not any(
            isinstance(f, _DropMatching) and f.pattern.pattern == pattern for f in logger.filters
        ):
            logger.addFilter(_DropMatching(pattern))
    for category, pattern in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
