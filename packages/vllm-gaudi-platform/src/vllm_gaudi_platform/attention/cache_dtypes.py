"""The KV cache dtypes of the HPU attention backends, shared by the backend (what it declares to
vLLM) and the platform (what it accepts in `--kv-cache-dtype`), without either importing the other.
"""

from __future__ import annotations

# What HPUAttentionBackend.supported_kv_cache_dtypes lists and the platform accepts.
HPU_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_inc", "fp8", "fp8_e4m3")
# vLLM's names for an FP8 E4M3 cache that it stores as uint8; the platform turns them into fp8_inc.
VLLM_UINT8_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
