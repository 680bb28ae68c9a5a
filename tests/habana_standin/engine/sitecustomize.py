"""Start-up hook of an engine process that runs the Gaudi backend over the Habana stand-in.

Put this directory on PYTHONPATH (with VLLM_HPU_EMULATION unset) and the interpreter imports it
first: the stand-in becomes importable as `habana_frameworks`, so the platform's device probe
finds a "Gaudi" and the seam resolves to `seam/gaudi`, unchanged. The stand-in's torch device
"hpu" is installed (`_torch_device.py`), so the engine's weights, KV cache, activations, index
tensors and sampled ids live on "hpu" as on a Gaudi, and an op that mixes them with CPU tensors
is refused as a device refuses it.

One fact of seam/gaudi is pointed elsewhere: its collectives backend. The stand-in has no HCCL, so
the process group is gloo's (these engines run one device; gloo carries vLLM's host-side
barriers and broadcasts).
"""

from __future__ import annotations

import os
import sys

_STANDIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _STANDIN not in sys.path:
    sys.path.insert(0, _STANDIN)


def _install_the_standin() -> None:
    os.environ["HABANA_STANDIN_TORCH_DEVICE"] = "1"
    import habana_frameworks.torch  # noqa: F401 - registers torch.ops.hpu.* and the device

    from vllm_gaudi_platform.seam import gaudi

    gaudi.DIST_BACKEND = "gloo"


_install_the_standin()
