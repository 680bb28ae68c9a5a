"""Intel Gaudi (HPU) platform plugin for vLLM.

`register` is the `vllm.platform_plugins` entry point named `hpu`.
"""

from __future__ import annotations

import logging

from vllm_gaudi_platform.version import __version__ as __version__

PLATFORM_CLASS = "vllm_gaudi_platform.platform.HpuPlatform"

_logger = logging.getLogger("vllm.vllm_gaudi_platform")


def register() -> str | None:
    """vLLM platform plugin: return the HPU platform class path, or None to stay inactive.

    Active when a Gaudi device is present (habana_frameworks importable and at least one device)
    or when VLLM_HPU_EMULATION=cpu asks for CPU emulation, and the installed vLLM is in the
    supported range (compat.py's policy, the same for every entry point). Never raises, because
    vLLM swallows platform-plugin exceptions without a word: every failure is logged at WARNING
    with the reason and turns into None. With no device and no emulation it imports neither torch
    nor vllm.
    """
    try:
        from vllm_gaudi_platform.seam.probe import probe_device

        probe = probe_device()
    except Exception as exc:
        _logger.warning("HPU platform inactive: %s", exc)
        return None
    if not probe.active:
        _logger.debug("HPU platform inactive: %s", probe.reason)
        return None
    from vllm_gaudi_platform import compat

    problem, proceed = compat.version_refusal()
    if not proceed:
        _logger.warning("HPU platform not registered: %s", problem)
        return None
    if problem is not None:
        _logger.warning("HPU platform: %s", problem)
    return PLATFORM_CLASS
