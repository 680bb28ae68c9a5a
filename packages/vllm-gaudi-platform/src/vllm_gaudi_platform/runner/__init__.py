"""The bucketed HPU model runner (`model_runner.py`) and its per-step helpers: HPU graphs, data
parallel padding, speculative decoding, LoRA, sleep mode, routed-experts capture, and the torch
stand-ins for the Triton kernels vLLM's shared runner code calls."""
