"""The gated delta net layers of Qwen3-Next and Qwen3.5 (dense and MoE) on the torch kernels of
`delta_rule.py` and `ssm.py`.

vLLM's `QwenGatedDeltaNetAttention` projects, then runs the short causal conv and the gated delta
rule through Triton kernels (flash-linear-attention) over varlen metadata, and its gated RMS norm
through another. `HpuQwenGatedDeltaNetAttention` keeps vLLM's projections (both checkpoint
layouts: Qwen3-Next's interleaved q/k/v/z groups, Qwen3.5's separate ones), weight loading and
output projection, and replaces the rest. It reads the HPU step layout (`HPUAttentionMetadata`
with the `state_*` fields, built by the platform's `HPUGatedDeltaNetBackend`), as the Mamba2
mixer of `families/mamba.py` does:

- prefill: the step's prefill cells, one request per row ([rows, query_bucket]), gathered from
  the token order through `cell_to_token`; the causal conv and the chunked gated delta rule run
  over the padded rows from each request's stored conv and recurrent states (zeros for a new
  request), and the final states are written back to the request's slot (with prefix caching,
  the slot of the block holding the step's last token);
- decode: one cell per request ([batch_bucket]), one conv step and one recurrent update each;
- the gated RMS norm is vLLM's own torch form (`RMSNormGated.forward_native`).

Padding rows and cells read and write slot 0, vLLM's null block, which no request owns. Every
shape is the bucket's: nothing depends on the step's data.
"""

from __future__ import annotations

import torch
from einops import rearrange
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from vllm_gaudi_ops import delta_rule, ssm, stats

FAMILY = "gdn"
CHUNK = 64  # flash-linear-attention's chunk size (a row shorter than this is one chunk)


class HpuQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """vLLM's gated delta net layer with the conv and delta rule on padded rows and state
    slots."""

    def get_attn_backend(self):  # type: ignore[no-untyped-def]
        from vllm_gaudi_platform.attention.mamba_state import HPUGatedDeltaNetBackend

        return HPUGatedDeltaNetBackend

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        mixed_qkv, z, b, a = self._project(hidden_states)
        core = torch.zeros(
            hidden_states.shape[0],
            self.num_v_heads // self.tp_size,
            self.head_v_dim,
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        self._conv_delta_rule(mixed_qkv, b, a, core)
        core = self.norm.forward_native(core, z)
        output, _ = self.out_proj(core.flatten(-2))
        return output

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v [T, conv_dim], z [T, HV, V], b [T, HV], a [T, HV]) from the input projections,
        in either checkpoint layout (vLLM's own split, as its CPU path does it)."""
        if hasattr(self, "in_proj_qkv"):
            raise ValueError(
                "gated delta net layers with separate in_proj_qkv / in_proj_z (vLLM's LoRA "
                "layout for Qwen3.5) are not supported on HPU; serve the model without LoRA."
            )
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        if self.gqa_interleaved_layout:  # Qwen3-Next: q/k/v/z interleaved per key-head group
            query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            query, key, value = (rearrange(t, "l p d -> l (p d)") for t in (query, key, value))
            return torch.cat((query, key, value), dim=-1), z, b, a
        qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
        b, a = self.split_ba(ba)
        return mixed_qkv, z.reshape(z.shape[0], -1, self.head_v_dim), b, a

    def _conv_delta_rule(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, output: torch.Tensor
    ) -> None:
        step = get_forward_context().attn_metadata
        md = step.get(self.prefix) if isinstance(step, dict) else None
        if md is None:  # a profiling run: no state to read or write
            return
        conv_state = self.kv_cache[0]  # per slot [W-1, conv_dim] (or [conv_dim, W-1])
        if is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        rec_state = self.kv_cache[1]  # per slot [HV, V, K]
        layout = md.layout
        first_decode = 0
        if layout.prefill is not None:
            rows, width = layout.prefill.rows, layout.prefill.query_bucket
            first_decode = rows * width
            if md.state_packed is None:  # one request per row: the bucket's shape
                cells = md.cell_to_token[:first_decode]
                o = self._prefill(
                    qkv[cells].view(rows, width, -1),
                    b[cells].view(rows, width, -1),
                    a[cells].view(rows, width, -1),
                    md.state_slots_prefill,
                    md.state_lens_prefill,
                    md.state_initial_prefill,
                    conv_state,
                    rec_state,
                )
                output[cells] = o.reshape(first_decode, *output.shape[1:]).to(output.dtype)
            else:
                # A packed row (an unwarmed step): each request on its own, at its own length.
                for row, col, n, slot, stored in md.state_packed:
                    start = row * width + col
                    cells = md.cell_to_token[start : start + n]
                    o = self._prefill(
                        qkv[cells][None],
                        b[cells][None],
                        a[cells][None],
                        torch.tensor([slot], device=qkv.device),
                        torch.tensor([n], device=qkv.device),
                        torch.tensor([float(stored)], device=qkv.device),
                        conv_state,
                        rec_state,
                    )
                    output[cells] = o.reshape(n, *output.shape[1:]).to(output.dtype)
        if layout.decode is not None:
            cells = md.cell_to_token[first_decode : first_decode + layout.decode.batch_bucket]
            o = self._decode(
                qkv[cells],
                b[cells],
                a[cells],
                md.state_slots_decode,
                md.state_initial_decode,
                conv_state,
                rec_state,
            )
            output[cells] = o.to(output.dtype)

    def _conv_weight(self) -> torch.Tensor:
        weight = self.conv1d.weight  # [conv_dim, 1, W]
        return weight.view(weight.shape[0], weight.shape[-1])

    def _split_heads(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Conv output [..., conv_dim] -> q, k [..., H, K], v [..., HV, V]."""
        key = self.key_dim // self.tp_size
        q, k, v = out.split([key, key, self.value_dim // self.tp_size], dim=-1)
        lead = out.shape[:-1]
        return (
            q.reshape(*lead, -1, self.head_k_dim),
            k.reshape(*lead, -1, self.head_k_dim),
            v.reshape(*lead, -1, self.head_v_dim),
        )

    def _prefill(
        self,
        qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        initial: torch.Tensor,
        conv_state: torch.Tensor,
        rec_state: torch.Tensor,
    ) -> torch.Tensor:
        stored = initial > 0
        conv0 = torch.where(stored[:, None, None], conv_state[slots], 0)
        out, conv_new = ssm.causal_conv1d_prefill(
            qkv,
            self._conv_weight(),
            self.conv1d.bias,
            conv0,
            lengths,
            silu=self.activation in ("silu", "swish"),
        )
        conv_state[slots] = conv_new.to(conv_state.dtype)
        q, k, v = self._split_heads(out)
        g, beta = delta_rule.gating(a, b, self.A_log, self.dt_bias)
        state0 = torch.where(stored[:, None, None, None], rec_state[slots].float(), 0)
        o, final = delta_rule.chunk_gated_delta_rule(
            q, k, v, g, beta, state0, lengths, min(CHUNK, q.shape[1]), self.head_k_dim**-0.5
        )
        rec_state[slots] = final.to(rec_state.dtype)
        return o

    def _decode(
        self,
        qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        slots: torch.Tensor,
        initial: torch.Tensor,
        conv_state: torch.Tensor,
        rec_state: torch.Tensor,
    ) -> torch.Tensor:
        stored = initial > 0
        conv0 = torch.where(stored[:, None, None], conv_state[slots], 0)
        out, conv_new = ssm.causal_conv1d_update(
            qkv,
            self._conv_weight(),
            self.conv1d.bias,
            conv0,
            silu=self.activation in ("silu", "swish"),
        )
        conv_state[slots] = conv_new.to(conv_state.dtype)
        q, k, v = self._split_heads(out)
        g, beta = delta_rule.gating(a, b, self.A_log, self.dt_bias)
        state0 = torch.where(stored[:, None, None, None], rec_state[slots].float(), 0)
        o, new = delta_rule.recurrent_step(state0, q, k, v, g, beta, self.head_k_dim**-0.5)
        rec_state[slots] = new.to(rec_state.dtype)
        return o


REPLACEMENTS: tuple[tuple[type, type], ...] = (
    (QwenGatedDeltaNetAttention, HpuQwenGatedDeltaNetAttention),
)
