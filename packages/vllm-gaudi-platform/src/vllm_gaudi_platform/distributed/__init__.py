"""Multi-node execution: preparing vLLM's Ray executor for HPU workers (`ray_cluster.py`). The
device communicator vLLM loads by name stays at `vllm_gaudi_platform.communicator`.

In-place weight updates from a trainer process: vLLM's weight-transfer engine "hpu"
(`weight_transfer.py`), its wire (`weight_wire.py`) and the trainer's client (`weight_sender.py`).
`register_weight_transfer` is the `vllm.general_plugins` entry point `hpu_weight_transfer`; it
imports neither torch nor vLLM until the platform is HPU.
"""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_weight_transfer")
def register_weight_transfer() -> None:
    """Register the "hpu" engine with vLLM's WeightTransferEngineFactory (once per process, in
    any order with the other plugins; a name already registered is left as it is)."""
    from vllm_gaudi_platform.distributed.weight_transfer import register

    register()
