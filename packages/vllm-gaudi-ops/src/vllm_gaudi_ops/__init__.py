"""Gaudi implementations of vLLM's custom ops, one `vllm.general_plugins` entry point per family.

The entry-point modules (`norm`, `rotary`, `activation`, `moe`, `encoder_attention`) only hold
the register functions and import nothing heavy; the replacement classes live in `layers/` and
call Gaudi kernels through the platform's hardware seam (`vllm_gaudi_platform.seam.backend()`),
which emulates them in torch under VLLM_HPU_EMULATION=cpu. `stats` counts each family's calls.
See the README for the families and how to trim them with VLLM_PLUGINS.
"""

__version__ = "0.1.0"
