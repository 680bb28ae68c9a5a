"""The Mamba2 mixer of hybrid models (Granite 4.0-H, ...) on the torch kernels of `ssm.py`.

vLLM's `MambaMixer2` projects, then runs conv + SSM through Triton kernels over varlen metadata
(decodes first, then prefills packed back to back). `HpuMambaMixer2` keeps vLLM's projections,
gated norm and weight loading, and replaces the conv + SSM step: it reads the HPU step layout
(`HPUAttentionMetadata` with the `state_*` fields, built by the platform's `HPUMamba2Backend`):

- prefill: the step's prefill cells, one request per row ([rows, query_bucket]), are gathered
  from the token order through `cell_to_token`; the causal conv and the chunked SSD scan run
  over the padded rows from each request's stored state (or zeros for a new request), and the
  final conv and SSM states are written back to the request's slot (with prefix caching, the
  slot of the block holding the step's last token);
- decode: one cell per request ([batch_bucket]), a single conv and state-update step each.

Padding rows and cells read and write slot 0, vLLM's null block, which no request owns. Every
shape is the bucket's: nothing depends on the step's data.
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from vllm_gaudi_ops import ssm, stats

FAMILY = "mamba"


class HpuMambaMixer2(MambaMixer2):
    """vLLM's Mamba2 mixer with the conv + SSM step on padded rows and state slots."""

    def get_attn_backend(self):  # type: ignore[no-untyped-def]
        from vllm_gaudi_platform.attention.mamba_state import HPUMamba2Backend

        return HPUMamba2Backend

    def get_kv_cache_spec(self, vllm_config):  # type: ignore[no-untyped-def]
        # vLLM's mixer declares a prefill checkpoint block (its Triton scan exports the state at
        # a block boundary inside a chunk); this one writes the state at a step's end only, so
        # with prefix caching the scheduler ends prefill chunks at block boundaries instead.
        return MambaBase.get_kv_cache_spec(self, vllm_config)

    def conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor) -> None:
        stats.count(FAMILY)
        conv_in, dt = torch.split(
            projected_states[..., self.tped_intermediate_size :],
            [self.tped_conv_size, self.tped_dt_size],
            dim=-1,
        )
        step = get_forward_context().attn_metadata
        md = step.get(self.prefix) if isinstance(step, dict) else None
        if md is None:  # a profiling run: no state to read or write
            output.zero_()
            return
        conv_state = self.kv_cache[0]  # per slot [W-1, conv_dim] (or [conv_dim, W-1])
        if is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        ssm_state = self.kv_cache[1]  # per slot [heads, head_dim, state]
        layout = md.layout
        first_decode = 0
        if layout.prefill is not None:
            rows, width = layout.prefill.rows, layout.prefill.query_bucket
            first_decode = rows * width
            if md.state_packed is None:  # one request per row: the bucket's shape
                cells = md.cell_to_token[:first_decode]
                y = self._prefill(
                    conv_in[cells].view(rows, width, -1),
                    dt[cells].view(rows, width, -1),
                    md.state_slots_prefill,
                    md.state_lens_prefill,
                    md.state_initial_prefill,
                    conv_state,
                    ssm_state,
                )
                output[cells] = y.reshape(first_decode, -1).to(output.dtype)
            else:
                # A packed row (an unwarmed step): each request on its own, at its own length.
                for row, col, n, slot, stored in md.state_packed:
                    start = row * width + col
                    cells = md.cell_to_token[start : start + n]
                    index = torch.tensor([slot], device=conv_in.device)
                    y = self._prefill(
                        conv_in[cells][None],
                        dt[cells][None],
                        index,
                        torch.tensor([n], device=conv_in.device),
                        torch.tensor([float(stored)], device=conv_in.device),
                        conv_state,
                        ssm_state,
                    )
                    output[cells] = y.reshape(n, -1).to(output.dtype)
        if layout.decode is not None:
            cells = md.cell_to_token[first_decode : first_decode + layout.decode.batch_bucket]
            y = self._decode(
                conv_in[cells],
                dt[cells],
                md.state_slots_decode,
                md.state_initial_decode,
                conv_state,
                ssm_state,
            )
            output[cells] = y.reshape(cells.shape[0], -1).to(output.dtype)

    def _split_conv_out(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., conv_dim] -> x [..., heads, head_dim], B and C [..., groups, state]."""
        x, b, c = self.split_hidden_states_B_C_fn(out)
        lead = out.shape[:-1]
        groups = self.n_groups // self.tp_size
        return (
            x.reshape(*lead, -1, self.head_dim),
            b.reshape(*lead, groups, self.ssm_state_size),
            c.reshape(*lead, groups, self.ssm_state_size),
        )

    def _prefill(
        self,
        conv_in: torch.Tensor,
        dt: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        initial: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        conv0 = conv_state[slots] * initial[:, None, None].to(conv_state.dtype)
        out, conv_new = ssm.causal_conv1d_prefill(
            conv_in,
            self.conv_weights,
            self.conv1d.bias,
            conv0,
            lengths,
            silu=self.activation in ("silu", "swish"),
        )
        conv_state[slots] = conv_new.to(conv_state.dtype)
        x, b, c = self._split_conv_out(out)
        chunk = self.model_config.get_mamba_chunk_size() if self.model_config else 256
        width = x.shape[1]
        chunk = min(chunk or 256, width)
        pad = -width % chunk
        if pad:  # a row length the chunk does not divide (an exact-shape step): pad the rows
            x, dt, b, c = (_pad_rows(t, pad) for t in (x, dt, b, c))
        state0 = ssm_state[slots].float() * initial[:, None, None, None]
        y, final = ssm.ssd_chunk_scan(
            x, dt, self.A, b, c, self.D, self.dt_bias, state0, lengths, chunk
        )
        ssm_state[slots] = final.to(ssm_state.dtype)
        return y[:, :width]

    def _decode(
        self,
        conv_in: torch.Tensor,
        dt: torch.Tensor,
        slots: torch.Tensor,
        initial: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        conv0 = conv_state[slots] * initial[:, None, None].to(conv_state.dtype)
        out, conv_new = ssm.causal_conv1d_update(
            conv_in,
            self.conv_weights,
            self.conv1d.bias,
            conv0,
            silu=self.activation in ("silu", "swish"),
        )
        conv_state[slots] = conv_new.to(conv_state.dtype)
        x, b, c = self._split_conv_out(out)
        state0 = ssm_state[slots] * initial[:, None, None, None].to(ssm_state.dtype)
        y, new = ssm.selective_state_update(state0, x, dt, self.A, b, c, self.D, self.dt_bias)
        ssm_state[slots] = new
        return y


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """[rows, L, ...] -> [rows, L + pad, ...] (zeros: past every row's length)."""
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))


REPLACEMENTS: tuple[tuple[type, type], ...] = ((MambaMixer2, HpuMambaMixer2),)
