"""vLLM's NIXL connector internals the HPU connector relies on."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        f"{NIXL}.metadata:NixlAgentMetadata",
        "HpuNixlConnectorWorker checks another platform's prefill instance with these fields",
        mentions=("block_lens", "block_size", "attn_backend_name"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.initialize_host_xfer_buffer",
        "an HPU prefill instance serving another platform: head-major host buffers (README)",
        mentions=("enable_permute_local_kv", "LBHNC", "host_buffer_kv_cache_layout"),
    ),
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:"
        "NixlBaseConnectorScheduler.__init__",
        "HpuNixlConnector checks the handshake port vLLM binds: side-channel host, port + DP index",
        mentions=(
            "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "VLLM_NIXL_SIDE_CHANNEL_PORT",
            "data_parallel_index",
        ),
    ),
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:"
        "NixlBaseConnectorScheduler._nixl_handshake_listener",
        "HpuNixlConnector's port check mirrors this bind (ZeroMQ ROUTER on host:port)",
        params=("encoded_data", "ready_event", "stop_event", "host", "port"),
        mentions=("ROUTER", "GET_META_MSG"),
    ),
    Upstream(
        f"{NIXL}.connector:NixlPullConnector.__init__",
        "HpuNixlConnector.__init__ creates what this does, with HpuNixlConnectorWorker",
        params=("vllm_config", "role", "kv_cache_config"),
        mentions=("NixlPullConnectorScheduler", "NixlPullConnectorWorker"),
    ),
    Upstream(
        f"{NIXL}.metadata:compute_nixl_compatibility_hash",
        "HpuNixlConnector's handshake compares these factors by name (HASHED_FIELDS)",
        mentions=(
            "vllm_version",
            "NIXL_CONNECTOR_VERSION",
            "get_total_num_kv_heads",
            "get_head_size",
            "get_total_num_hidden_layers",
            "attn_backend_name",
            "cache_dtype",
            "disable_hybrid_kv_cache_manager",
            "transfer_mode",
        ),
    ),
    Upstream(f"{NIXL}.metadata:GET_META_MSG", "HpuNixlConnectorWorker's field query"),
    Upstream(f"{NIXL}.metadata:NIXL_CONNECTOR_VERSION", "HpuNixlConnector's compatibility fields"),
    Upstream(
        f"{NIXL}.metadata:NixlHandshakePayload",
        "HpuNixlHandshakePayload extends it with the compatibility fields",
        params=("compatibility_hash", "agent_metadata_bytes"),
    ),
    Upstream(
        f"{NIXL}.utils:zmq_ctx",
        "HpuNixlConnectorWorker queries the remote side channel with it",
        params=("socket_type", "addr"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker._nixl_handshake",
        "HpuNixlConnectorWorker compares the compatibility fields before this handshake",
        params=(
            "host",
            "port",
            "remote_tp_size",
            "expected_engine_id",
            "remote_dcp_size",
            "remote_pp_size",
            "notif_agents_only",
        ),
        mentions=("GET_META_MSG", "RCVTIMEO", "compat_hash", "enforce_compat_hash"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.register_kv_caches",
        "HpuNixlConnectorWorker wraps the payload this sets; reads the block size, backend name",
        mentions=("transfer_topo", "compat_hash", "backend_name", "block_size"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.__init__",
        "HpuNixlConnectorWorker reads these attributes and sets use_host_buffer after it",
        mentions=(
            "xfer_handshake_metadata",
            "enforce_compat_hash",
            "use_host_buffer",
            "kv_buffer_device",
            "copy_blocks",
            "vllm_config",
        ),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.set_host_xfer_buffer_ops",
        "HpuNixlConnectorWorker overrides it: keeps the copy operation for an emulated device",
        params=("copy_operation",),
        mentions=("copy_blocks",),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.save_kv_to_host",
        "host staging out of the KV cache: the platform's swap_out_blocks_to_host via copy_blocks",
        mentions=("copy_blocks", "host_xfer_buffers", "d2h"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.sync_recved_kv_to_device",
        "host staging into the KV cache: the platform's insert_blocks_to_device via copy_blocks",
        mentions=("copy_blocks", "host_xfer_buffers", "h2d"),
    ),
    Upstream(
        f"{NIXL}.base_scheduler:NixlBaseConnectorScheduler.__init__",
        "HpuNixlConnectorScheduler sets use_host_buffer after it (saves prefilled blocks)",
        mentions=("use_host_buffer", "kv_buffer_device"),
    ),
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.utils:copy_kv_blocks",
        "the copy operation the runner hands the connector: calls the platform's staging hooks",
        params=("src_kv_caches", "dst_kv_caches", "src_block_ids", "dst_block_ids", "direction"),
        mentions=("insert_blocks_to_device", "swap_out_blocks_to_host"),
    ),
    Upstream(f"{NIXL}.base_worker:NixlBaseConnectorWorker._TRANSFER_MODE", "the compat fields"),
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.utils:TransferTopology.handshake_target_ranks",
        "HpuNixlConnectorWorker asks the remote rank vLLM's handshake asks first",
        params=("remote_tp_size", "remote_dcp_size"),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "HpuNixlConnector subclasses vLLM's NIXL pull connector and adds the HPU's host "
        "transfer buffer and handshake fields."
    ),
    can_go="when vLLM's NIXL connector takes the device's transfer path as a platform hook only.",
    upstream=UPSTREAM,
)
