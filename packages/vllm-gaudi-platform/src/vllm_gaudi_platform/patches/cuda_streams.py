"""torch's CUDA stream and event API, routed to the seam while vLLM's runner code runs."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream("torch:Event", "cuda_streams.py routes it to the seam (cuda_streams_on_seam)"),
    Upstream("torch:cuda.Stream", "cuda_streams.py routes it to the seam"),
    Upstream("torch:cuda.Event", "cuda_streams.py routes it to the seam (drops `blocking`)"),
    Upstream("torch:cuda.current_stream", "cuda_streams.py routes it to the seam"),
    Upstream("torch:cuda.stream", "cuda_streams.py routes it to the seam"),
    Upstream(
        "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput.__init__",
        "HPUModelRunner.sample_tokens: under async scheduling this copies the sampled tokens on a "
        "side stream, through the CUDA names routed to the seam",
        mentions=("Event", "current_stream", "stream", "wait_stream", "record"),
    ),
)

PATCH = Patch(
    what=(
        "`torch.Event`, `torch.cuda.{Event, Stream, current_stream, stream}` routed to the "
        "seam's streams and events while `GPUModelRunner.__init__`, `execute_model` and "
        "`sample_tokens` run, then restored."
    ),
    why=(
        "the runner's constructor creates CUDA events and streams, and under async scheduling "
        "every step records an event and copies the sampled tokens on a side stream; all of "
        "these fail without CUDA."
    ),
    can_go=(
        "when vLLM creates them through the platform (a device-neutral "
        "`torch.Stream(device=...)` or a platform hook)."
    ),
    sites=("vllm_gaudi_platform.worker.cuda_stand_ins.cuda_streams:cuda_streams_on_seam",),
    scope="call",
    upstream=UPSTREAM,
)
