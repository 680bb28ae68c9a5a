"""Speculative decoding on HPU: which drafters run, and the bucket shapes of verification steps.

A verification step scores, for each sequence with drafts, its last sampled token plus its k draft
tokens: a query of 1 + k tokens on top of the sequence's cached context. The runner lays such
requests out like prefills with context (one grid row per request, see `step_layout.py`), so they
need buckets `(batch_size, 1 + k, ctx_blocks)` with the batch sizes of decode and the context
(per sequence) of prefill. `with_verify_buckets` adds these to the plan as phase "verify"; warmup
runs them and the recompile tracker counts any verification shape they miss.

Rejection sampling itself is vLLM's, with plain-torch stand-ins for its Triton kernels
(`cuda_stand_ins/triton_kernels.py`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan

# Drafters that run on HPU today. The n-gram drafter needs no draft model: it looks up the last
# tokens in the prompt and output. EAGLE and EAGLE-3 heads, and the MTP layers a checkpoint carries
# (method "mtp", run by the same vLLM proposer), run on the HPU attention backend, their forward
# passes padded to the target's buckets (`HPUModelRunner` plans and warms them), with plain-torch
# stand-ins for the Triton kernels of vllm/v1/spec_decode/utils.py that prepare their inputs.
SUPPORTED_METHODS = ("ngram", "eagle", "eagle3", "mtp")

# Why the others are refused, for the error message.
_REFUSED = {
    "medusa": "Medusa heads are not supported on HPU",
    "draft_model": "a separate draft model needs the parallel-drafting input kernels",
}

VERIFY_PHASE = "verify"


def check_speculative_config(speculative_config: Any) -> None:
    """Refuse, before any engine starts, a speculative method the HPU platform cannot run."""
    if speculative_config is None:
        return
    method = getattr(speculative_config, "method", None)
    if method in SUPPORTED_METHODS:
        if getattr(speculative_config, "parallel_drafting", False):
            raise ValueError(
                f"speculative_config method {method!r} with parallel drafting is not supported "
                "on HPU (its input kernels have no HPU stand-in); use a head without parallel "
                "drafting or drop speculative_config."
            )
        if method == "ngram" and importlib.util.find_spec("numba") is None:
            # vLLM's n-gram proposer is numba code; vLLM's CPU and CUDA requirements bring numba,
            # its common ones (all a Gaudi-style build, VLLM_TARGET_DEVICE=empty, installs) do not.
            raise ValueError(
                "speculative_config method 'ngram' needs numba (vLLM's n-gram proposer is "
                "compiled by it), which is not installed; pip install numba, or use another "
                "method or drop speculative_config."
            )
        if getattr(speculative_config, "disable_padded_drafter_batch", False) and method != "ngram":
            raise ValueError(
                "speculative_config disable_padded_drafter_batch=True is not supported on HPU "
                "(the drafter's forward passes run on the target's padded buckets); leave it "
                "unset."
            )
        return
    reason = _REFUSED.get(str(method), "it is not supported on HPU")
    raise ValueError(
        f"speculative_config method {method!r}: {reason}; supported: "
        f"{', '.join(SUPPORTED_METHODS)}. Use speculative_config={{'method': 'ngram', "
        "'num_speculative_tokens': k, 'prompt_lookup_max': n, 'prompt_lookup_min': m}, or "
        "{'method': 'eagle', 'model': <draft head>, 'num_speculative_tokens': k}, "
        "{'method': 'mtp', 'num_speculative_tokens': k} for a model with MTP layers, "
        "or drop speculative_config."
    )


def num_speculative_tokens(speculative_config: Any) -> int:
    """k of the config (0 without speculative decoding)."""
    if speculative_config is None:
        return 0
    return int(getattr(speculative_config, "num_speculative_tokens", 0) or 0)


def _doubling(top: int) -> list[int]:
    values, v = {top}, 1
    while v < top:
        values.add(v)
        v *= 2
    return sorted(values)


def verify_buckets(
    plan: BucketPlan,
    *,
    num_speculative_tokens: int,
    max_model_len: int,
    block_size: int,
    max_num_batched_tokens: int,
) -> tuple[Bucket, ...]:
    """The verification buckets for k = `num_speculative_tokens` drafts per sequence.

    Batch sizes: those of the plan's decode buckets (verification replaces decode for sequences
    with drafts), kept where batch * (1 + k) fits the token budget. Context blocks per sequence:
    1, 2, 4, ... up to the most a sequence can hold before its last 1 + k tokens (a sequence being
    verified has at least its prompt in the cache).
    """
    k = num_speculative_tokens
    if k <= 0:
        return ()
    query = 1 + k
    ctx_max = max(1, -(-(max_model_len - query) // block_size))
    batch_sizes = sorted({b.batch_size for b in plan.decode}) or [1]
    return tuple(
        Bucket(VERIFY_PHASE, bs, query, c)
        for bs in batch_sizes
        if bs * query <= max_num_batched_tokens
        for c in _doubling(ctx_max)
    )


def with_verify_buckets(plan: BucketPlan, buckets: tuple[Bucket, ...]) -> BucketPlan:
    """`plan` with the verification buckets among its prefill-shaped buckets.

    They share the prompt lookup: a step's requests with more than one new token take the
    cheapest warmed prefill-shaped bucket that holds them, so a verification step (and a short
    prompt) lands on a verify bucket, and a long prompt on a prompt bucket.
    """
    if not buckets:
        return plan
    return dataclasses.replace(plan, prompt=(*plan.prompt, *buckets))


# ------------------------------------------------------------------ model-based drafters
# vLLM's EAGLE proposer (vllm/v1/spec_decode/llm_base_proposer.py) runs its head once over the
# step's tokens (the "first pass", the same requests and query lengths as the target's step) and
# then k - 1 times over one token per request. It asks `_determine_batch_execution_and_padding`
# how many tokens to run (CUDA-graph padding on GPUs) and builds the attention metadata through
# `build_per_group_and_layer_attn_metadata`. `DraftBucketing` wraps both on the proposer so that
# each pass runs on a bucket of the target's plan: the first pass on the target step's own bucket,
# the others on the decode bucket of the batch. Warmup runs the head on every bucket of the plan
# (`warm`), and every drafting pass is checked against the warmed set like a target step.
# Under torch.compile the head's passes are compiled per bucket like the target's (`compile`):
# the proposer's `model` becomes a `CompiledDraftHead`.


class DraftBucketing:
    """Pads an EAGLE-style proposer's forward passes to the runner's buckets."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.drafter = runner.drafter
        self.active = False
        self._first_pass: Any = None  # layout of the pass whose padding was not yet asked for
        self._decode_batch = 0  # batch bucket of this proposal's one-token passes
        self._first_seq_lens: list[int] = []
        self._build = self.drafter.build_per_group_and_layer_attn_metadata
        self._pad = self.drafter._determine_batch_execution_and_padding
        self.drafter.build_per_group_and_layer_attn_metadata = self.build_metadata
        self.drafter._determine_batch_execution_and_padding = self.padding

    def propose(self) -> Any:
        """Context for one `propose_draft_token_ids` call of the runner."""
        bucketing = self

        class _Proposal:
            def __enter__(self) -> None:
                bucketing.active = True
                bucketing._first_pass = None
                bucketing._decode_batch = 0

            def __exit__(self, *exc: Any) -> None:
                bucketing.active = False
                step_layout.set_current(None)

        return _Proposal()

    # -- the proposer's hooks
    def build_metadata(self, common_attn_metadata: Any, draft_index: int = 0) -> Any:
        if not self.active:
            return self._build(common_attn_metadata, draft_index=draft_index)
        # The HPU builder reads the host-side upper bound of the sequence lengths when present;
        # the proposer only ever raises it, while rejected drafts shorten the sequences. Drafting
        # attends to the exact lengths (one device-to-host copy per pass).
        cad = dataclasses.replace(common_attn_metadata, seq_lens_cpu_upper_bound=None)
        layout = self._layout(cad)
        self.runner.recompiles.record(layout)
        step_layout.set_current(layout)
        try:
            return self._build(cad, draft_index=draft_index)
        finally:
            step_layout.set_current(None)

    def padding(self, num_tokens: int, use_cudagraphs: bool = True) -> tuple[Any, int, Any]:
        if not self.active:
            return self._pad(num_tokens, use_cudagraphs=use_cudagraphs)
        from vllm.config import CUDAGraphMode

        first = self._first_pass
        if first is not None and sum(first.query_lens) == num_tokens:
            self._first_pass = None
            return CUDAGraphMode.NONE, first.num_tokens_padded, None
        # The one-token passes: the batch bucket that holds the batch at its longest (each pass
        # adds a token per request, at most k - 1 of them after the first pass).
        k = max(num_speculative_tokens(self.runner.speculative_config), 1)
        block_size = self.runner.block_size
        blocks = sum(-(-(s + k) // block_size) for s in self._first_seq_lens[:num_tokens])
        bucket = self.runner.bucket_plan.find_decode(num_tokens, blocks)
        self._decode_batch = bucket.batch_size if bucket is not None else num_tokens
        return CUDAGraphMode.NONE, self._decode_batch, None

    def _layout(self, cad: Any) -> step_layout.StepLayout:
        num_reqs = cad.num_reqs
        qsl = cad.query_start_loc_cpu[: num_reqs + 1].tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
        seq_lens = [int(x) for x in cad.seq_lens[:num_reqs].tolist()]
        plan = self.runner.bucket_plan
        block_size = self.runner.block_size
        if self._decode_batch and all(q == 1 for q in query_lens):
            blocks = sum(-(-s // block_size) for s in seq_lens)
            bucket = plan.find_decode(self._decode_batch, blocks)
            if bucket is not None and bucket.batch_size == self._decode_batch:
                decode = step_layout.DecodePart(
                    bucket.batch_size, bucket.ctx_blocks, tuple(range(num_reqs)), bucket, True
                )
                return step_layout.StepLayout(tuple(query_lens), None, decode)
            exact = Bucket("decode", self._decode_batch, 1, blocks)
            decode = step_layout.DecodePart(
                self._decode_batch, blocks, tuple(range(num_reqs)), exact, False
            )
            return step_layout.StepLayout(tuple(query_lens), None, decode)
        layout = step_layout.plan_step(
            query_lens=query_lens, seq_lens=seq_lens, block_size=block_size, plan=plan
        )
        self._first_pass = layout
        self._first_seq_lens = seq_lens
        return layout

    def compile(self, target: Any, backend: str) -> None:
        """Run the head's drafting and warmup passes through torch.compile with `backend`, per
        bucket like the target (`target`: its compiled.CompiledModel, whose statistics the
        head's graphs join under labels starting with "draft ")."""
        from vllm_gaudi_platform.worker.compiled import CompiledModel

        head = CompiledModel(
            self.drafter.model,
            backend,
            strict=target.strict,
            publish=target._publish,
            stats=target.stats,
            label_prefix="draft ",
        )
        self.drafter.model = CompiledDraftHead(self.drafter.model, head, self)

    # -- warmup
    def warm(self, attn_metadata: dict[str, Any], total: int) -> None:
        """Run the head once on a bucket whose target pass just ran (same metadata, so the
        head's layers read and write the same warmup blocks)."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import set_forward_context

        drafter = self.drafter
        kwargs: dict[str, Any] = {
            "input_ids": drafter.input_ids[:total],
            "positions": drafter._get_positions(total),
        }
        if drafter.pass_hidden_states_to_model:
            kwargs["hidden_states"] = drafter.hidden_states[:total]
        with set_forward_context(
            attn_metadata,
            self.runner.vllm_config,
            num_tokens=total,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
        ):
            self.active = True
            try:
                drafter.model(**kwargs)
            finally:
                self.active = False


class CompiledDraftHead:
    """The proposer's draft head with its forward passes through torch.compile: a pass on one of
    the runner's buckets (drafting, or warmup) runs the compiled head with bucket-shaped metadata;
    any other call (vLLM's profiling dummy run) runs it eagerly. Everything else the proposer
    reads of its model (compute_logits, combine_hidden_states, its submodules) is the head's, and
    it passes for the head's class (vLLM's EAGLE-3 proposer checks the head's type)."""

    def __init__(self, head: Any, compiled_model: Any, bucketing: DraftBucketing) -> None:
        self.__dict__.update(_head=head, _compiled=compiled_model, _bucketing=bucketing)

    def __call__(self, **kwargs: Any) -> Any:
        if not self._bucketing.active or not self._bucketing.runner.compiled_forward_on:
            return self._head(**kwargs)
        from vllm.forward_context import get_forward_context

        return self._compiled.run(get_forward_context(), **kwargs)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(proxy, HeadClass) is True
        return type(self._head)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._head, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._head, name)


def draft_bucketing(runner: Any) -> DraftBucketing | None:
    """Bucketing for the runner's drafter if it runs a model (EAGLE, EAGLE-3, MTP), else None."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "build_per_group_and_layer_attn_metadata"):
        return None
    return DraftBucketing(runner)
