"""The metadata of state-space layers (Mamba2, gated delta net): the HPU backends vLLM is handed
for them.

A Mamba layer keeps no paged keys and values: per request it keeps one state slot (conv and SSM
state) in its KV-cache group, whose block table holds that slot in its first column (vLLM's
`mamba_cache_mode` "none"); with prefix caching ("align"), one slot per block of tokens, and
the step reads and writes the slot of the block holding its last token. It reads the same step
layout as the attention layers (prefill rows of one request each, decode cells), so its
metadata is `HPUAttentionMetadata` built from the step's layout, plus each row's and decode
cell's state slot (`metadata.state_fields`). The layers themselves are the ops wheel's
`hpu_ops_mamba` (Mamba2 mixers) and `hpu_ops_gdn` (gated delta net) families; both read the
same metadata (a gated delta net layer's slot holds its conv and recurrent states).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionBackend, CommonAttentionMetadata

from vllm_gaudi_platform.attention import host_tables, step_layout
from vllm_gaudi_platform.attention.metadata_builder import HPUAttentionMetadataBuilder


class HPUStateMetadataBuilder(HPUAttentionMetadataBuilder):
    # A state-space layer scans each prefill row as one sequence.
    pack_prefills = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Prefix caching ("align"): one slot per block of tokens, the running state in the block
        # of the step's last token; otherwise one slot per request.
        self.slot_tokens = (
            int(kv_cache_spec.block_size)
            if vllm_config.cache_config.mamba_cache_mode == "align"
            else None
        )
        # The step layout counts context in the attention layers' blocks (the state group's
        # block size counts tokens per state slot).
        self.block_size = vllm_config.cache_config.block_size
        self.mm_prefix = False

    def block_table(
        self, cm: CommonAttentionMetadata, layout: step_layout.StepLayout, seq_lens: list[int]
    ) -> torch.Tensor:
        # No paged attention reads these layers' blocks: a table of the null block, as wide as
        # the layout's context needs.
        width = max((-(-s // self.block_size) for s in seq_lens), default=0)
        return torch.zeros(cm.num_reqs, width, dtype=torch.int32)

    def state_slots(self, cm: CommonAttentionMetadata, seq_lens: list[int]) -> list[int]:
        table = host_tables.host_rows(cm.block_table_tensor, cm.num_reqs)
        if self.slot_tokens is None:
            return table[:, 0].tolist()
        # vLLM copied each request's state into this block before the step (mamba_state_copies.py).
        columns = [max(s - 1, 0) // self.slot_tokens for s in seq_lens]
        index = torch.tensor(columns, dtype=torch.int64, device=table.device).unsqueeze(1)
        return table.gather(1, index)[:, 0].tolist()


class HPUStateBackend(AttentionBackend):
    """What vLLM builds a state-space layer's metadata with on HPU (the layer computes itself):
    the base of the backends the ops wheel's state-layer families hand vLLM."""

    @staticmethod
    def get_name() -> str:
        return "HPU_STATE"

    @staticmethod
    def get_impl_cls():  # type: ignore[no-untyped-def]
        raise NotImplementedError("state-space layers compute in their own forward pass")

    @staticmethod
    def get_builder_cls() -> type[HPUStateMetadataBuilder]:
        return HPUStateMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


class HPUMamba2Backend(HPUStateBackend):
    """Mamba2 mixers (`hpu_ops_mamba`)."""

    @staticmethod
    def get_name() -> str:
        return "HPU_MAMBA2"


class HPUGatedDeltaNetBackend(HPUStateBackend):
    """Gated delta net layers (`hpu_ops_gdn`)."""

    @staticmethod
    def get_name() -> str:
        return "HPU_GDN"
