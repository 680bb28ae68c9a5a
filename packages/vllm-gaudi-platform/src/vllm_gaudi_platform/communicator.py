"""Device communicator for tensor parallelism: HCCL on Gaudi, gloo in CPU emulation.

The process groups are created by vLLM with the platform's `dist_backend` ("hccl" or "gloo"), so
the collectives themselves are torch.distributed's. What Gaudi adds: in lazy mode, pending ops
must be flushed (mark_step) before a collective reads its input.

Mixture-of-experts layers under data parallelism exchange tokens between DP ranks through vLLM's
all-gather / reduce-scatter all2all manager, which calls `all_gatherv` and `reduce_scatterv` on
the DP group's communicator; both are built here from collectives gloo and HCCL both have.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

from vllm_gaudi_platform.seam import backend as seam_backend


class HPUCommunicator(DeviceCommunicatorBase):
    def __init__(self, cpu_group, device=None, device_group=None, unique_name: str = "", **kw):
        super().__init__(cpu_group, device, device_group, unique_name, **kw)
        self.seam = seam_backend()
        if self.use_all2all:
            # The expert-parallel group of a data-parallel MoE model: tokens go to every DP rank
            # by all-gather and come back by reduce-scatter (vLLM's device-neutral manager).
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

            self.all2all_manager = AgRsAll2AllManager(self.cpu_group)

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        self.seam.mark_step()
        dist.all_reduce(input_, group=self.device_group)
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.seam.mark_step()
        if dim < 0:
            dim += input_.dim()
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(parts, input_, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        # The parameter keeps the base class's name: vLLM's callers may pass it by keyword.
        self.seam.mark_step()
        dist.broadcast(tensor, src=self.ranks[src], group=self.device_group)
        return tensor

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Gather tensors whose size along `dim` differs per rank (`sizes`, one per rank).

        Each rank's part is padded to the largest size so one fixed-shape all_gather moves them
        (gloo has no variable-size gather); the padding is cut off again after.
        """
        if isinstance(input_, list):
            return [self._all_gatherv_one(t, dim, sizes) for t in input_]
        return self._all_gatherv_one(input_, dim, sizes)

    def _all_gatherv_one(
        self, input_: torch.Tensor, dim: int, sizes: list[int] | None
    ) -> torch.Tensor:
        if dim < 0:
            dim += input_.dim()
        if sizes is None:
            return self.all_gather(input_, dim)
        self.seam.mark_step()
        width = max(sizes)
        x = input_.movedim(dim, 0)
        if x.shape[0] < width:
            pad = x.new_zeros((width - x.shape[0], *x.shape[1:]))
            x = torch.cat([x, pad])
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.device_group)
        out = torch.cat([p[:n] for p, n in zip(parts, sizes)])
        return out.movedim(0, dim).contiguous()

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """Sum `input_` over the ranks and keep this rank's slice along `dim` (`sizes` per rank,
        equal slices when None): an all_reduce and a slice, which gloo supports."""
        if dim < 0:
            dim += input_.dim()
        x = input_.movedim(dim, 0).contiguous()
        if sizes is None:
            sizes = [x.shape[0] // self.world_size] * self.world_size
        if sum(sizes) != x.shape[0]:
            raise ValueError(f"reduce_scatterv sizes {sizes} do not add up to {x.shape[0]}")
        self.seam.mark_step()
        dist.all_reduce(x, group=self.device_group)
        start = sum(sizes[: self.rank_in_group])
        return x[start : start + sizes[self.rank_in_group]].movedim(0, dim).contiguous()

    def dispatch_router_logits(self, hidden_states, router_logits, *args: Any, **kwargs: Any):
        if self.all2all_manager is None:
            return super().dispatch_router_logits(hidden_states, router_logits, *args, **kwargs)
        return self.all2all_manager.dispatch_router_logits(
            hidden_states, router_logits, *args, **kwargs
        )

    def dispatch(self, hidden_states, topk_weights, topk_ids, *args: Any, **kwargs: Any):
        if self.all2all_manager is None:
            return super().dispatch(hidden_states, topk_weights, topk_ids, *args, **kwargs)
        return self.all2all_manager.dispatch(hidden_states, topk_weights, topk_ids, *args, **kwargs)

    def combine(self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False):
        if self.all2all_manager is None:
            return super().combine(hidden_states, is_sequence_parallel)
        return self.all2all_manager.combine(hidden_states, is_sequence_parallel)
