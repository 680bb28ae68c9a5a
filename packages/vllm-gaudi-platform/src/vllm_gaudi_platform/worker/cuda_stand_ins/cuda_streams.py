"""The CUDA stream/event API that vLLM's runner calls, routed to the seam's streams and events
while `HPUModelRunner.__init__`, `execute_model` and `sample_tokens` run (see the ledger
entry patches/cuda_streams.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vllm_gaudi_platform.seam import backend as seam_backend


@contextlib.contextmanager
def cuda_streams_on_seam() -> Iterator[None]:
    """Route the CUDA stream/event API that vLLM's runner calls to the seam's streams and events.

    The constructor makes events and streams; under async scheduling each step also records an
    event on the input preparation and copies the sampled tokens to the host on a side stream
    (`AsyncGPUModelRunnerOutput`). On a Gaudi these become HPU streams and events; in emulation
    the seam's are exact for a CPU that finishes every op before returning.
    """
    seam = seam_backend()

    def event(*args: Any, blocking: bool | None = None, **kwargs: Any) -> Any:
        # CUDA's `blocking` (sleep rather than spin while waiting) has no HPU counterpart.
        return seam.Event(*args, **kwargs)

    patched = {
        (torch, "Event"): seam.Event,
        (torch.cuda, "Event"): event,
        (torch.cuda, "Stream"): seam.Stream,
        (torch.cuda, "current_stream"): seam.current_stream,
        (torch.cuda, "stream"): seam.stream,
    }
    # Process-wide, for the duration of the call only (ledger: patches/cuda_streams.py).
    saved = {key: getattr(*key) for key in patched}
    for (module, name), value in patched.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
