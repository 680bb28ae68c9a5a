"""The speculative-decoding proposer's metadata and padding hooks, replaced on the drafter
instance."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        f"{PROPOSER}.build_per_group_and_layer_attn_metadata",
        "spec_decode.DraftBucketing wraps it to plan the drafting pass's bucket",
        params=("common_attn_metadata", "draft_index"),
    ),
    Upstream(
        f"{PROPOSER}._determine_batch_execution_and_padding",
        "spec_decode.DraftBucketing wraps it to pad a drafting pass to its bucket",
        params=("num_tokens", "use_cudagraphs"),
    ),
    Upstream(
        f"{PROPOSER}.propose",
        "DraftBucketing: first pass (build, then padding), one-token passes (padding, builds)",
        mentions=(
            "build_per_group_and_layer_attn_metadata",
            "_determine_batch_execution_and_padding",
        ),
    ),
    Upstream(
        f"{PROPOSER}._update_positions_dependent_metadata",
        "DraftBucketing drops the host upper bound of the lengths it raises here",
        mentions=("seq_lens_cpu_upper_bound",),
    ),
    Upstream(
        f"{PROPOSER}._get_positions",
        "DraftBucketing.warm runs the head on the proposer's buffers",
        params=("num_tokens",),
    ),
    Upstream(
        f"{PROPOSER}.__init__",
        "DraftBucketing.warm reads the proposer's buffers",
        mentions=("self.input_ids", "self.hidden_states", "self.pass_hidden_states_to_model"),
    ),
    Upstream(
        f"{RUNNER}._setup_eagle3_aux_hidden_state_outputs",
        "HPUModelRunner.load_model calls it for EAGLE-3 heads, as vLLM's load_model does",
    ),
    Upstream(
        f"{RUNNER}.propose_draft_token_ids",
        "HPUModelRunner.propose_draft_token_ids brackets it for DraftBucketing",
    ),
    # MTP drafting (tests/integration/mtp_drafts.py builds a MiMo checkpoint with an MTP layer).
    Upstream(
        "vllm.config.speculative:SpeculativeConfig.hf_config_override",
        "mtp_drafts: a MiMoForCausalLM config with num_nextn_predict_layers drafts with MiMoMTP",
        mentions=("MiMoForCausalLM", "MiMoMTPModel", "num_nextn_predict_layers"),
    ),
    Upstream(
        "vllm.model_executor.models.mimo_mtp:MiMoMultiTokenPredictorLayer.__init__",
        "mtp_drafts names the MTP layer's weights after these modules",
        mentions=("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
    ),
    Upstream(
        "vllm.model_executor.models.mimo_mtp:MiMoMTP.__init__",
        "mtp_drafts stores the MTP layer under model.mtp_layers.0 (vLLM remaps the index)",
        mentions=("mtp_layers", "mtp_block"),
    ),
    Upstream(
        "vllm.model_executor.models.mimo_mtp:MiMoMTP.forward",
        "DraftBucketing.warm runs an MTP layer like an EAGLE head, by these names",
        params=("input_ids", "positions", "hidden_states"),
    ),
)

PATCH = Patch(
    what=(
        "`build_per_group_and_layer_attn_metadata` and `_determine_batch_execution_and_padding` "
        "replaced on the runner's drafter instance (DraftBucketing); the draft head wrapped by "
        "a proxy that passes for the head's class (`__class__`) and forwards attribute writes "
        "to it (CompiledDraftHead)."
    ),
    why=(
        "the proposer's forward passes must run on the runner's warmed buckets with "
        "bucket-shaped metadata, and vLLM's EAGLE-3 proposer checks the head's type."
    ),
    can_go="when vLLM's proposer asks the platform for its padding and metadata.",
    sites=(
        "vllm_gaudi_platform.worker.spec_decode:DraftBucketing.__init__",
        "vllm_gaudi_platform.worker.spec_decode:CompiledDraftHead.__setattr__",
        "vllm_gaudi_platform.worker.spec_decode:CompiledDraftHead.__delattr__",
    ),
    scope="object",
    upstream=UPSTREAM,
)
