"""The `vllm.general_plugins` entry points of the op families, one attribute per family.

The entry point `hpu_ops_<family> = "vllm_gaudi_ops.register:<family>"` loads
`vllm_gaudi_ops.register.<family>`: a register function built on first access from the family
module `vllm_gaudi_ops.families.<family>` (see `replacement.family_plugin`). Nothing here is
written per family, so adding one is its module plus that pyproject line. Loading an entry point
imports neither torch nor vLLM: vLLM loads every general plugin in every process, whatever the
platform, and the family module (which imports vLLM's layers) is imported only when the register
function runs on HPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from vllm_gaudi_ops.replacement import family_plugin

ENTRY_POINT_PREFIX = "hpu_ops_"
FAMILIES_PACKAGE = "vllm_gaudi_ops.families"

_built: dict[str, Callable[[], None]] = {}


def __getattr__(family: str) -> Callable[[], None]:
    """The register function of `family` (PEP 562: `register.norm`, `register.rotary`, ...)."""
    if family in _built:
        return _built[family]
    if not family.isidentifier() or family.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {family!r}")
    module = f"{FAMILIES_PACKAGE}.{family}"
    if importlib.util.find_spec(module) is None:
        raise AttributeError(
            f"no op family {family!r}: the entry point {ENTRY_POINT_PREFIX}{family} needs the "
            f"module {module} (vllm_gaudi_ops/families/{family}.py); fix the entry point's value "
            "in the wheel's pyproject or add the module"
        )
    _built[family] = family_plugin(ENTRY_POINT_PREFIX + family, module)
    return _built[family]
