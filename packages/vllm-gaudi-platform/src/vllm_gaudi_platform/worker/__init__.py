"""The HPU worker and what it drives, as vLLM's `v1/worker` holds its GPU worker and runner:
`hpu_worker.py` (one process, one HPU: device, KV cache, sleep mode, stats), `model_runner.py`
(every forward pass padded to a warmed bucket) and the runner's per-step helpers: model loading,
warmup, recompile tracking, mixed prefill + decode steps, HPU graphs and torch.compile, data
parallel padding, speculative decoding, LoRA, sleep mode, routed-experts capture, vision shapes,
Mamba hybrids and seeded sampling. `cuda_stand_ins/` holds what vLLM's shared runner code calls
that only CUDA has (Triton kernels, CUDA streams), done for the HPU."""
