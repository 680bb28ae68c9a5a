"""The attention backends of the HPU platform: the decoder backend (`backend.py`: prefill with
and without context, decode, windows, encoder-only), multi-head latent attention (`mla.py`), and
the step layout both build their metadata from (`step_layout.py`)."""
