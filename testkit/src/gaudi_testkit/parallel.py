"""vLLM's parallel state for one process, for layer-level jobs (tests, benchmarks) that build
vLLM layers without an engine: its parallel linear and MoE layers read it."""

from __future__ import annotations


def single_process_parallel() -> None:
    """Tensor, pipeline and expert parallelism of size 1 over gloo, once per process."""
    import socket

    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    initialize_model_parallel(1, 1)
