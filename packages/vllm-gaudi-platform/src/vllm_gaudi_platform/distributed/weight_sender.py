"""The trainer's side of in-place weight updates on the HPU, and the engine-side calls around it.

In the training process (torch only; no vLLM, no device needed)::

    from vllm_gaudi_platform.distributed.weight_sender import HpuWeightSender

    sender = HpuWeightSender("10.0.0.5", 29555, world_size=1 + num_inference_workers)
    sender.connect()                      # blocks until every inference worker has joined
    sender.send(model.named_parameters())  # one round: every tensor, checkpoint (HF) names

In the process that holds the engine (`LLM(..., weight_transfer_config={"backend": "hpu"})`)::

    from vllm_gaudi_platform.distributed import weight_sender

    weight_sender.connect_engine(llm, sender_init_info)  # while the trainer runs connect()
    weight_sender.apply_update(llm)                      # while the trainer runs send()

`connect` and `connect_engine` rendezvous with each other, as do `send` and `apply_update`: run
each pair at the same time (two processes, or two threads). The trainer listens on
`master_port` (it hosts the rendezvous store); `world_size` is 1 + data_parallel_size *
tensor_parallel_size * pipeline_parallel_size of the engine. Names are the checkpoint's (what
`named_parameters()` of the Hugging Face model gives); the engine maps them, fuses and shards
them as its loader does. `bucket_bytes` packs consecutive tensors into one broadcast (0: one
broadcast per tensor). A served engine (vLLM's OpenAI server with its RL routes) takes the same
calls over HTTP: pause with `clear_cache`, `init_weight_transfer_engine`, `start_weight_update`,
`update_weights` with `{"update_info": {}}`, `finish_weight_update`, resume.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vllm_gaudi_platform.distributed import weight_wire


class HpuWeightSender:
    """Rank 0 of the trainer-and-workers group: sends rounds of named tensors."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        timeout_s: float = weight_wire.DEFAULT_TIMEOUT_S,
        bucket_bytes: int = weight_wire.DEFAULT_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: 0 (one tensor per bucket) or more")
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.group: weight_wire.WireGroup | None = None
        self.rounds_sent = 0

    def init_info(self) -> dict[str, Any]:
        """What the engine's `init_weight_transfer_engine` takes (`connect_engine`'s argument)."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "rank_offset": 1,
            "timeout_s": self.timeout_s,
        }

    def connect(self) -> None:
        """Open the group; returns once every inference worker has joined (or raises at the
        timeout)."""
        self.group = weight_wire.WireGroup(
            self.master_address, self.master_port, 0, self.world_size, self.timeout_s
        )

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        stop_after_buckets: int | None = None,
    ) -> weight_wire.RoundPlan:
        """Send one round (every tensor given); the engine writes it once all has arrived.
        `stop_after_buckets` is for tests: give up mid-round, as a dying trainer would."""
        if self.group is None:
            raise RuntimeError("HpuWeightSender.send before connect()")
        plan = weight_wire.send_round(
            self.group,
            named_tensors,
            round_no=self.rounds_sent,
            bucket_bytes=self.bucket_bytes,
            stop_after_buckets=stop_after_buckets,
        )
        self.rounds_sent += 1
        return plan

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None


# ---------------------------------------------------------------------- the engine's side
def connect_engine(llm: Any, init_info: dict[str, Any]) -> None:
    """Join the trainer's group from every worker of an offline `LLM`."""
    llm.init_weight_transfer_engine({"init_info": dict(init_info)})


def apply_update(llm: Any, names: list[str] | None = None) -> None:
    """Receive one round into an offline `LLM` and make it serve it: start, receive (written in
    place once complete), finish, then reset the prefix cache, whose blocks hold keys and values
    the old weights computed. `names`, if given, must be what the trainer sends. Call it between
    `generate` calls: the offline engine runs no step meanwhile."""
    llm.start_weight_update()
    update: dict[str, Any] = {} if names is None else {"names": list(names)}
    # A failed update_weights ends the session in vLLM's worker: nothing to finish then.
    llm.update_weights({"update_info": update})
    llm.finish_weight_update()
    if not llm.reset_prefix_cache():
        raise RuntimeError("weights updated, but the prefix cache could not be reset")
