"""The Gaudi backend of the seam: the ONLY package in the tree that imports habana_frameworks.

The backend `seam.backend()` returns on a Gaudi: thin wrappers providing `contract.HpuBackend`,
the same API as `emulated.py`. Off Gaudi, the tests run this package over the Habana stand-in
(tests/habana_standin), which enforces the input rules of Habana's kernels; on a Gaudi the same
tests (marked `gaudi`) run it over the real stack. Where a wrapper adapts an input to a kernel's
rule, the comment names the source of the rule.

Its modules by kind, each re-exported here by name (`from ... import x as x`, the form
`tests/platform/test_seam_contract.py` reads): `runtime.py` (identity, device, memory, graphs,
streams), `attention.py` (fused SDPA, paged decode, MLA), `kernels.py` (RMS norm, linear, rotary,
KV block copies, LoRA), `moe.py` (mixture of experts), `quant.py` (4-bit and FP8).
"""

from __future__ import annotations

from vllm_gaudi_platform.seam.gaudi.attention import fused_sdpa as fused_sdpa
from vllm_gaudi_platform.seam.gaudi.attention import mla_paged_decode as mla_paged_decode
from vllm_gaudi_platform.seam.gaudi.attention import mla_prefill as mla_prefill
from vllm_gaudi_platform.seam.gaudi.attention import paged_decode as paged_decode
from vllm_gaudi_platform.seam.gaudi.kernels import ROPE_BLOCKWISE as ROPE_BLOCKWISE
from vllm_gaudi_platform.seam.gaudi.kernels import ROPE_PAIRWISE as ROPE_PAIRWISE
from vllm_gaudi_platform.seam.gaudi.kernels import apply_rotary_pos_emb as apply_rotary_pos_emb
from vllm_gaudi_platform.seam.gaudi.kernels import copy_blocks as copy_blocks
from vllm_gaudi_platform.seam.gaudi.kernels import linear as linear
from vllm_gaudi_platform.seam.gaudi.kernels import lora_expand as lora_expand
from vllm_gaudi_platform.seam.gaudi.kernels import lora_shrink as lora_shrink
from vllm_gaudi_platform.seam.gaudi.kernels import rms_norm as rms_norm
from vllm_gaudi_platform.seam.gaudi.moe import MOE_ACTIVATIONS as MOE_ACTIVATIONS
from vllm_gaudi_platform.seam.gaudi.moe import mixture_of_experts as mixture_of_experts
from vllm_gaudi_platform.seam.gaudi.moe import mixture_of_experts_fp8 as mixture_of_experts_fp8
from vllm_gaudi_platform.seam.gaudi.moe import mixture_of_experts_mxfp4 as mixture_of_experts_mxfp4
from vllm_gaudi_platform.seam.gaudi.quant import cast_from_fp8 as cast_from_fp8
from vllm_gaudi_platform.seam.gaudi.quant import cast_to_fp8_v2 as cast_to_fp8_v2
from vllm_gaudi_platform.seam.gaudi.quant import convert_from_uint4 as convert_from_uint4
from vllm_gaudi_platform.seam.gaudi.quant import fp8_gemm_v2 as fp8_gemm_v2
from vllm_gaudi_platform.seam.gaudi.quant import fp8_max as fp8_max
from vllm_gaudi_platform.seam.gaudi.runtime import COMPILE_BACKEND as COMPILE_BACKEND
from vllm_gaudi_platform.seam.gaudi.runtime import DEVICE_TYPE as DEVICE_TYPE
from vllm_gaudi_platform.seam.gaudi.runtime import DISPATCH_KEY as DISPATCH_KEY
from vllm_gaudi_platform.seam.gaudi.runtime import DIST_BACKEND as DIST_BACKEND
from vllm_gaudi_platform.seam.gaudi.runtime import IS_EMULATED as IS_EMULATED
from vllm_gaudi_platform.seam.gaudi.runtime import NAME as NAME
from vllm_gaudi_platform.seam.gaudi.runtime import NIXL_DEVICE_MEMORY as NIXL_DEVICE_MEMORY
from vllm_gaudi_platform.seam.gaudi.runtime import PIN_MEMORY as PIN_MEMORY
from vllm_gaudi_platform.seam.gaudi.runtime import SHARED_HOST_MEMORY as SHARED_HOST_MEMORY
from vllm_gaudi_platform.seam.gaudi.runtime import Event as Event
from vllm_gaudi_platform.seam.gaudi.runtime import Graph as Graph
from vllm_gaudi_platform.seam.gaudi.runtime import Stream as Stream
from vllm_gaudi_platform.seam.gaudi.runtime import current_stream as current_stream
from vllm_gaudi_platform.seam.gaudi.runtime import device_count as device_count
from vllm_gaudi_platform.seam.gaudi.runtime import device_name as device_name
from vllm_gaudi_platform.seam.gaudi.runtime import graphs_supported as graphs_supported
from vllm_gaudi_platform.seam.gaudi.runtime import mark_step as mark_step
from vllm_gaudi_platform.seam.gaudi.runtime import max_memory_allocated as max_memory_allocated
from vllm_gaudi_platform.seam.gaudi.runtime import mem_get_info as mem_get_info
from vllm_gaudi_platform.seam.gaudi.runtime import memory_allocated as memory_allocated
from vllm_gaudi_platform.seam.gaudi.runtime import (
    reset_peak_memory_stats as reset_peak_memory_stats,
)
from vllm_gaudi_platform.seam.gaudi.runtime import set_device as set_device
from vllm_gaudi_platform.seam.gaudi.runtime import stream as stream
from vllm_gaudi_platform.seam.gaudi.runtime import synchronize as synchronize
from vllm_gaudi_platform.seam.gaudi.runtime import torch_device as torch_device
