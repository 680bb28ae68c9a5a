"""The Gaudi replacements of vLLM's CustomOp classes, one module per op family.

These modules import vLLM's layers at import time, so only a family's `register()` (run on an
HPU platform) imports them. Each exposes FAMILY (its name in `vllm_gaudi_ops.stats`) and
REPLACEMENTS: (in-tree class, Gaudi subclass) pairs.
"""
