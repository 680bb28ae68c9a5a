"""Start-up hook of an engine process that runs the Gaudi backend over the Habana stand-in.

Put this directory on PYTHONPATH (with VLLM_HPU_EMULATION unset) and the interpreter imports it
first: the stand-in becomes importable as `habana_frameworks`, so the platform's device probe
finds a "Gaudi" and the seam resolves to `seam/gaudi.py`. The stand-in's device is CPU memory, so
gaudi.py's device facts are pointed at the CPU (tensor device, dispatch key, collectives backend);
everything else (kernels, runtime, HPU graphs) is gaudi.py over the stand-in.
"""

from __future__ import annotations

import os
import sys

_STANDIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _STANDIN not in sys.path:
    sys.path.insert(0, _STANDIN)


def _point_gaudi_at_the_cpu() -> None:
    import habana_frameworks.torch  # noqa: F401 - registers torch.ops.hpu.*
    import torch

    from vllm_gaudi_platform.seam import gaudi

    gaudi.DEVICE_TYPE = "cpu"
    gaudi.DISPATCH_KEY = "CPU"
    gaudi.DIST_BACKEND = "gloo"
    gaudi.torch_device = lambda index=0: torch.device("cpu")


_point_gaudi_at_the_cpu()
