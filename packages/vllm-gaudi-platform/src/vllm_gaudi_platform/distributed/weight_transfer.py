"""vLLM's weight-transfer engine for the HPU (`weight_transfer_config={"backend": "hpu"}`).

A trainer process (`weight_sender.py`) sends named tensors in checkpoint (Hugging Face) names over
the gloo group of `weight_wire.py`; each worker receives a whole round into host memory first and
only then writes it into the served model, through the model's own `load_weights` (its name
mapping, fused q/k/v and gate/up shards, tensor-parallel slicing), IN PLACE: every parameter keeps
its storage. HPU graphs and compiled buckets hold the tensors they captured, so a parameter given
new storage would leave them computing with the old weights; after the loader runs, any parameter
it rebound is copied back into its original storage and the original restored. No graph is
recaptured and nothing recompiles.

The prefix cache is the caller's, as everywhere in vLLM: KV blocks computed with the old weights
must not serve the new ones. `weight_sender.apply_update` (offline `LLM`) and vLLM's
`pause_generation(clear_cache=True)` (served engines) reset it.

Quantized models: an `fp8` checkpoint's linear layers take the trainer's high-precision weights
and re-quantize them on the way in, writing the FP8 weight and its scales into their storage
(`weight_quantized.py`); every other method (AWQ, GPTQ, INC, compressed-tensors, MXFP4) and the
FP8 MoE experts are refused at start, each naming why and the fix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_gaudi_platform.distributed import weight_quantized, weight_wire

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

logger = logging.getLogger("vllm.vllm_gaudi_platform.weight_transfer")

BACKEND = "hpu"


@dataclass
class HpuWeightTransferInitInfo(WeightTransferInitInfo):
    """Where the trainer's rendezvous store listens and how many processes the group has
    (the trainer plus every inference worker). `rank_offset` is the first worker's rank (1:
    the trainer is 0). `timeout_s` bounds every wait on the trainer."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = weight_wire.DEFAULT_TIMEOUT_S


@dataclass
class HpuWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One `update_weights` call receives one round from the trainer; the round describes
    itself (names, dtypes, shapes, buckets) on the wire. `names`, if given, is checked against
    what arrived: a trainer that sends other tensors than the caller announced is refused."""

    names: list[str] | None = None


def refusal(vllm_config: VllmConfig) -> str | None:
    """Why this engine cannot update the model of `vllm_config`, or None."""
    return weight_quantized.refusal(vllm_config, BACKEND)


class HpuWeightTransferEngine(
    WeightTransferEngine[HpuWeightTransferInitInfo, HpuWeightTransferUpdateInfo]
):
    init_info_cls = HpuWeightTransferInitInfo
    update_info_cls = HpuWeightTransferUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        problem = refusal(vllm_config)
        if problem is None and model is not None:
            quantization = getattr(vllm_config.model_config, "quantization", None)
            problem = weight_quantized.model_refusal(model, quantization)
        if problem is not None:
            raise ValueError(problem)
        super().__init__(config, vllm_config, device, model)
        from vllm_gaudi_platform.seam import backend

        self.seam = backend()
        self.group: weight_wire.WireGroup | None = None
        self.rank = -1
        self.rounds_applied = 0
        self.last_round = -1
        self.params_written = 0
        self.rebinds_restored = 0
        self.last_error: str | None = None
        self.last_seconds = 0.0
        # The worker's sleep state, when the worker gives it (engine_for_worker).
        self.asleep: Callable[[], bool] | None = None

    # ------------------------------------------------------------------ lifecycle
    def init_transfer_engine(self, init_info: HpuWeightTransferInitInfo) -> None:
        if self.group is not None:
            self.shutdown()
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        rank = init_info.rank_offset + worker
        logger.info(
            "HPU weight transfer: joining the trainer at %s:%d as rank %d of %d",
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
        )
        self.group = weight_wire.WireGroup(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )
        self.rank = rank

    def start_weight_update(self) -> None:
        if self.asleep is not None and self.asleep():
            # Asleep, the parameters' storage is off the device (level 1: a host copy that
            # wake_up copies back; level 2: none, wake_up reloads the checkpoint): a round written
            # now would be undone by wake_up.
            raise RuntimeError(
                "HPU weight transfer: the worker is asleep (sleep mode); call wake_up() before "
                "start_weight_update, or the update would be lost when it wakes"
            )
        if self.group is None:
            raise RuntimeError(self._not_connected())

    def finish_weight_update(self) -> None:
        return None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes through torch.accelerator, which knows no HPU backend of
        # ours; the seam's synchronize is the device's (a no-op in emulation).
        self.receive_weights(self.parse_update_info(update_info))
        self.seam.synchronize()

    def receive_weights(self, update_info: HpuWeightTransferUpdateInfo) -> None:
        group = self.group
        if group is None:
            raise RuntimeError(self._not_connected())
        start = time.perf_counter()
        error: str | None = None
        cause: Exception | None = None
        round_no, tensors = -1, list[tuple[str, torch.Tensor]]()
        try:
            round_no, tensors = weight_wire.receive_round(group)
        except Exception as exc:
            cause = exc
            error = (
                f"weight update failed while receiving from the trainer ({type(exc).__name__}: "
                f"{exc})"
            )
        names = [name for name, _ in tensors]
        if error is None and update_info.names is not None and list(update_info.names) != names:
            error = (
                f"weight update round {round_no}: the trainer sent {len(names)} tensors that are "
                f"not the {len(update_info.names)} names update_weights announced"
            )
        # Every worker of the engine writes the round, or none does: tensor-parallel ranks
        # holding different weights would serve garbage.
        if not self._all_workers_agree(error is None):
            # A failed gloo group cannot be used again: every worker closes its end, and the
            # caller inits a new group with a live trainer.
            self.shutdown()
            self.last_error = (
                f"{error or 'another worker of this engine failed to receive the round'}; no "
                f"parameter was written on any worker and the model serves the weights of "
                f"{self._serving()}. The transfer group is closed: call "
                "init_weight_transfer_engine again with a live trainer."
            )
            if self._reports_failures():
                raise RuntimeError(self.last_error) from cause
            logger.error("HPU weight transfer: %s", self.last_error)
            return
        self._apply(tensors)
        self.rounds_applied += 1
        self.last_round = round_no
        self.last_error = None
        self.last_seconds = time.perf_counter() - start
        logger.info(
            "HPU weight transfer: round %d applied in place (%d tensors, %.2f s)",
            round_no,
            len(tensors),
            self.last_seconds,
        )

    def _vote_group(self) -> Any:
        """vLLM's group of the workers one update call reaches (this engine's), or None."""
        from vllm.distributed import parallel_state

        parallel = self.parallel_config
        if parallel.world_size == 1 and parallel.data_parallel_size == 1:
            return None
        if parallel.data_parallel_size == 1:
            return parallel_state.get_world_group()
        if parallel.pipeline_parallel_size == 1:
            return parallel_state.get_tp_group()
        return None

    def _all_workers_agree(self, ok: bool) -> bool:
        group = self._vote_group()
        if group is None or group.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
        return bool(flag.item())

    def _reports_failures(self) -> bool:
        """Whether this worker raises a failed round to the caller: the last worker of the vote
        only. vLLM's multiprocess executor reads the workers' replies in rank order and stops at
        the first failure, leaving the later ranks' replies queued as answers to the NEXT call;
        a failure raised by the last rank alone reaches the caller with every reply read."""
        group = self._vote_group()
        return group is None or group.rank_in_group == group.world_size - 1

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    # ------------------------------------------------------------------ writing
    def _apply(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load `tensors` through the model's loader, keeping every parameter's storage."""
        model = self.model
        before = {
            name: (param, param.data)
            for name, param in model.named_parameters(remove_duplicate=False)
        }
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with (
            torch.no_grad(),
            disable_mtp_completeness_check(),
            weight_quantized.staged_weights(model) as staged,
        ):
            loaded = model.load_weights(iter(tensors))
            staged.append(loaded)
        restored = 0
        with torch.no_grad():
            for name, param in model.named_parameters(remove_duplicate=False):
                original, storage = before.get(name, (None, None))
                if original is None or storage is None:
                    raise RuntimeError(
                        f"weight update: the model's loader added parameter {name!r}; the HPU "
                        "engine updates existing parameters only"
                    )
                if param is not original or param.data.data_ptr() != storage.data_ptr():
                    # The loader rebound the parameter: write its value into the captured storage
                    # and put the captured parameter back.
                    storage.copy_(param.data)
                    original.data = storage
                    if param is not original:
                        _set_parameter(model, name, original)
                    restored += 1
        if restored:
            logger.warning(
                "HPU weight transfer: the model's loader gave %d parameters new storage; their "
                "values were copied back into the storage the graphs captured",
                restored,
            )
        self.rebinds_restored += restored
        self.params_written += len(loaded) if loaded is not None else len(tensors)

    def _serving(self) -> str:
        if self.rounds_applied == 0:
            return "the checkpoint it loaded"
        return f"update round {self.last_round}"

    def _not_connected(self) -> str:
        return (
            "HPU weight transfer is not connected to a trainer: call init_weight_transfer_engine "
            "with the trainer's master_address, master_port and world_size first"
            + (f" (the last round failed: {self.last_error})" if self.last_error else "")
        )

    def report(self) -> dict:
        """What the engine did, for tests and logs."""
        return {
            "backend": BACKEND,
            "connected": self.group is not None,
            "rank": self.rank,
            "rounds_applied": self.rounds_applied,
            "last_round": self.last_round,
            "params_written": self.params_written,
            "rebinds_restored": self.rebinds_restored,
            "last_error": self.last_error,
            "last_seconds": self.last_seconds,
        }


def _set_parameter(model: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module._parameters[attr] = param


def register() -> None:
    """Register the engine with vLLM's factory under "hpu" (once per process; a name already
    taken is left alone: the factory refuses a second registration)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "vllm_gaudi_platform.distributed.weight_transfer", "HpuWeightTransferEngine"
        )


def registered() -> bool:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    return BACKEND in WeightTransferEngineFactory._registry


# vLLM's own backends, built on CUDA: NCCL communicators, CUDA IPC handles, CUDA streams.
CUDA_BACKENDS = ("nccl", "ipc", "sparse_nccl", "nccl_m2n", "sharded_rdt")


def engine_for_worker(
    vllm_config: VllmConfig,
    device: torch.device,
    model: torch.nn.Module,
    asleep: Callable[[], bool] | None = None,
) -> WeightTransferEngine | None:
    """The weight-transfer engine an HPU worker holds after loading its model (what vLLM's GPU
    worker does in its load_model), or None without `weight_transfer_config`. `asleep` tells
    whether the worker sleeps (an update is refused then)."""
    config = vllm_config.weight_transfer_config
    if config is None:
        return None
    if config.backend in CUDA_BACKENDS:
        raise ValueError(
            f"weight_transfer_config backend {config.backend!r} is vLLM's CUDA transport (NCCL "
            "communicators, CUDA IPC handles, CUDA streams) and does not run on the HPU; use "
            f'weight_transfer_config={{"backend": "{BACKEND}"}} (vllm_gaudi_platform.distributed.'
            "weight_sender on the trainer's side)"
        )
    register()  # the entry point did it unless VLLM_PLUGINS left it out; idempotent
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    engine = WeightTransferEngineFactory.create_engine(config, vllm_config, device, model)
    if isinstance(engine, HpuWeightTransferEngine):
        engine.asleep = asleep
    return engine
