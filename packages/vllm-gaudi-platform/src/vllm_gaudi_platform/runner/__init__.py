"""The bucketed HPU model runner (`model_runner.py`) and its per-step helpers: the warmup driver
(`warmup.py`), recompile tracking (`recompiles.py`), mixed prefill + decode steps
(`mixed_steps.py`), the CUDA stream routing to the seam (`cuda_streams.py`), HPU graphs, data
parallel padding, speculative decoding, LoRA, sleep mode, routed-experts capture, and the torch
stand-ins for the Triton kernels vLLM's shared runner code calls."""
