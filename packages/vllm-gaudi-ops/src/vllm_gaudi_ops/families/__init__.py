"""The op families, one module per family: `families/<family>.py` is the whole family.

A family module holds the Gaudi subclasses of vLLM's CustomOp classes (each overriding
`forward_oot` and calling `stats.count(FAMILY)`), `FAMILY` (its name in `vllm_gaudi_ops.stats`,
the module's own name) and `REPLACEMENTS`: (in-tree class, Gaudi subclass) pairs. Its entry point
is one line in the wheel's pyproject, `hpu_ops_<family> = "vllm_gaudi_ops.register:<family>"`;
`vllm_gaudi_ops.register` builds the register function. Family modules import vLLM's layers at
import time, so only that register function (run on an HPU platform) imports them; this package
itself imports nothing.
"""
