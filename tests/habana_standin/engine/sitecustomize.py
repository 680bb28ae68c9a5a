"""Start-up hook of an engine process that runs the Gaudi backend over the Habana stand-in.

Put this directory on PYTHONPATH (with VLLM_HPU_EMULATION unset) and the interpreter imports it
first: the stand-in becomes importable as `habana_frameworks`, so the platform's device probe
finds a "Gaudi" and the seam resolves to `seam/gaudi`, unchanged. The stand-in's torch device
"hpu" is installed (`_torch_device.py`), so the engine's weights, KV cache, activations, index
tensors and sampled ids live on "hpu" as on a Gaudi, and an op that mixes them with CPU tensors
is refused as a device refuses it.

The collectives backend is seam/gaudi's own, "hccl": the stand-in registers it
(`habana_frameworks/torch/distributed/hccl.py`), so tensor-parallel engines run their collectives
on "hpu" tensors as on a Gaudi.
"""

from __future__ import annotations

import os
import sys

_STANDIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _STANDIN not in sys.path:
    sys.path.insert(0, _STANDIN)


def _install_the_standin() -> None:
    os.environ["HABANA_STANDIN_TORCH_DEVICE"] = "1"
    import habana_frameworks.torch  # noqa: F401 - registers torch.ops.hpu.*, the device, hccl


_install_the_standin()
