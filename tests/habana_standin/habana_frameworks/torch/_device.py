"""The stand-in device's state: which Gaudi it is, and the execution mode of the process."""

from __future__ import annotations

import os

# Which Gaudi the stand-in is: tests set GENERATION to 2 to check Gaudi 2 behaviour; a process
# (an engine, a benchmark) picks it with HABANA_STANDIN_GENERATION=2 or 3.
GENERATION = int(os.environ.get("HABANA_STANDIN_GENERATION", "3"))
if GENERATION not in (2, 3):
    raise ValueError(f"HABANA_STANDIN_GENERATION={GENERATION}: the stand-in is a Gaudi 2 or 3")
# Fact: each process acquires one Gaudi and names it torch.device("hpu") (Intel's vllm-gaudi
# uses "hpu" with no index and makes set_device a no-op; Habana's documentation: one device
# per process).
DEVICES_PER_PROCESS = 1


def generation() -> int:
    return GENERATION


def device_name() -> str:
    # Fact: the bridge reports the device as "GAUDI2" / "GAUDI3" (Intel's plugin tests
    # get_device_name() for "GAUDI2" to pick Gaudi 2 settings, e.g. the FP8 range).
    return f"GAUDI{GENERATION}"


def lazy_mode() -> bool:
    """Fact: PT_HPU_LAZY_MODE=1 selects lazy mode (ops accumulate into a graph flushed by
    mark_step); 0 is eager / torch.compile. Read when asked, as the bridge reads it at start."""
    return os.environ.get("PT_HPU_LAZY_MODE", "1") == "1"
