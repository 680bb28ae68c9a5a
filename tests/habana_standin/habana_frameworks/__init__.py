"""A strict CPU stand-in for Intel Gaudi's `habana_frameworks` (tests only; see ../README.md).

Refuses to load where a real `habana_frameworks` is importable: the tests then run the Gaudi
backend over the real thing, and a stand-in shadowing it would hide the hardware from them.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ELSEWHERE = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if importlib.machinery.PathFinder.find_spec("habana_frameworks", _ELSEWHERE) is not None:
    raise ImportError(
        "the Habana stand-in refuses to load: a real habana_frameworks is importable, and the "
        "Gaudi tests must run over it"
    )

STANDIN = True  # what a test asks to tell the stand-in from Habana's package
