"""Seeded sampling's CPU generators, made rewindable the way vLLM rewinds CUDA's."""

from __future__ import annotations

import torch


class RewindableGenerator(torch.Generator):
    """A CPU generator that vLLM can rewind by one step: `set_offset` (CUDA's Philox offset,
    which vLLM moves back by the draws of a discarded sample) restores the state the runner
    saved before the step's sampling; `get_offset` only feeds that arithmetic."""

    def __new__(cls, source: torch.Generator) -> RewindableGenerator:
        return super().__new__(cls, device="cpu")  # type: ignore[call-arg]

    def __init__(self, source: torch.Generator) -> None:  # the device is set by __new__
        self.set_state(source.get_state())
        self.snapshot = self.get_state()

    def get_offset(self) -> int:  # type: ignore[override]
        return 0

    def set_offset(self, offset: int) -> None:  # type: ignore[override]
        self.set_state(self.snapshot)
