"""habana_frameworks.torch.core: mark_step."""

from __future__ import annotations

from habana_frameworks.torch import _device

MARK_STEPS = 0  # how many lazy-mode flushes ran (tests read it)


def mark_step() -> None:
    """Fact: in lazy mode, flushes the ops accumulated so far as one graph; outside lazy mode
    it is a no-op (bridge: core/step_closure.py, decorated lazy-only). On the CPU every op has
    already run, so only the count changes."""
    global MARK_STEPS
    if _device.lazy_mode():
        MARK_STEPS += 1
