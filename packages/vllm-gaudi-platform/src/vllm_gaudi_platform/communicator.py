"""Device communicator for tensor parallelism: HCCL on Gaudi, gloo in CPU emulation.

The process groups are created by vLLM with the platform's `dist_backend` ("hccl" or "gloo"), so
the collectives themselves are torch.distributed's. What Gaudi adds: in lazy mode, pending ops
must be flushed (mark_step) before a collective reads its input.
"""

from __future__ import annotations

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

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.seam.mark_step()
        dist.broadcast(input_, src=self.ranks[src], group=self.device_group)
        return input_
