"""The attention backends of the HPU platform: the decoder backend (`backend.py`, the class vLLM is
handed; `impl.py`, its forward: prefill with and without context, decode, windows, encoder-only,
FP8 cache; `metadata.py`, its per-step metadata; `metadata_builder.py`, how a step fills it),
multi-head latent attention (`mla.py`), the step layout both build their metadata from
(`step_layout.py`) and the KV cache dtypes (`cache_dtypes.py`)."""
