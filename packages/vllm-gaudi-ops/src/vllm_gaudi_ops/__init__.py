"""Gaudi implementations of vLLM's custom ops, one `vllm.general_plugins` entry point per family.

Each op family is one module in `families/`: the Gaudi subclasses of vLLM's CustomOp classes and
their REPLACEMENTS. They call Gaudi kernels through the platform's hardware seam
(`vllm_gaudi_platform.seam.backend()`), which emulates them in torch under VLLM_HPU_EMULATION=cpu.
The entry points (`register.<family>`) are built by `replacement.family_plugin` and import nothing
heavy; `stats` counts each family's calls. See the README for the families and how to trim them
with VLLM_PLUGINS.
"""

# The four wheels share one version (this wheel pins the platform at exactly it).
from vllm_gaudi_platform.version import __version__ as __version__
