"""Lets torchvision's Python parts import where its compiled ops cannot load.

vLLM's vision-language models need torchvision's Python parts: transformers' image and video
processors (Qwen2-VL's among them) and Pixtral's processor, which Llava's vLLM module imports.
Where a torchvision wheel's compiled library (`torchvision/_C.so`) does not load against the
installed torch (a CUDA build of torchvision beside a CPU torch, which is what some wheel stores
hold), `import torchvision` fails: `torchvision/_meta_registrations.py` registers fake kernels
for `torchvision::nms` and `torchvision::qnms` unconditionally, and those operators are only
defined by the library that did not load ("operator torchvision::nms does not exist").

`install()` (run at interpreter start by `gaudi_testkit_torchvision.pth`, which this kit installs
into the development venv and the packaging tests' clean venvs; no published wheel carries it)
puts a one-shot import hook in front of torchvision. On the first lookup of torchvision the hook
tries to load torchvision's library itself. When that works (the CPU build `torchvision==X+cpu`
from PyTorch's CPU index, or a Gaudi image) it changes nothing. When it fails, the hook defines
the two operator schemas, without kernels, so the import succeeds; torchvision's compiled ops
(nms, roi_align, deform_conv2d, ...) stay unavailable and raise when called (a DEBUG log line
says so). Nothing here imports torch or torchvision before something asks for torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_logger = logging.getLogger("vllm.gaudi_testkit.torchvision_schemas")

# Operators whose fake kernels torchvision registers whether or not its library loaded
# (torchvision/_meta_registrations.py, 0.2x): their schemas, as the library defines them.
SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

# What the hook did: None until torchvision is looked up, then
# "native" (its library loaded) or the load error it worked around.
state: dict[str, Any] = {"outcome": None}
_library: Any = None  # the torch.library fragment; kept alive, or its schemas go away


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    """Runs `prepare()` on the first lookup of torchvision, then steps aside for good."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision":
            return None
        uninstall()
        try:
            prepare()
        except Exception as exc:  # never break an import that would otherwise work
            _logger.warning("torchvision schema hook failed, torchvision imports as is: %s", exc)
        return None  # the normal finders import torchvision


def install() -> None:
    """Put the hook in front of torchvision's import (once; a no-op if torchvision is loaded)."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionHook())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchvisionHook)]


def _library_path() -> Path | None:
    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("_C*.so")) + sorted(Path(folder).glob("_C*.pyd"))
        if found:
            return found[0]
    return None


def prepare() -> str | None:
    """Load torchvision's compiled library, or define the schemas its import needs.

    Returns None when there is nothing to do (no torchvision, or its library loads), else the
    load error that was worked around.
    """
    global _library
    lib_path = _library_path()
    if lib_path is None:
        return None
    import torch

    try:
        torch.ops.load_library(str(lib_path))
    except (OSError, RuntimeError) as exc:
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    else:
        state["outcome"] = "native"
        return None
    missing = {name: schema for name, schema in SCHEMAS.items() if not _defined(torch, name)}
    if missing:
        _library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in missing.values():
            _library.define(schema)
    state["outcome"] = error
    # DEBUG: every process imports torchvision, on any platform, and our plugins stay quiet
    # where the HPU platform is not the platform (doctor reports this instead).
    _logger.debug(
        "torchvision's compiled ops do not load with this torch (%s); its Python parts (image "
        "and video transforms, the processors of vision-language models) work, its compiled ops "
        "(nms, roi_align, ...) raise. Install the torchvision build made for this torch (for a "
        "CPU torch: PyTorch's CPU index) to have both.",
        error,
    )
    return error


def _defined(torch: Any, name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True
