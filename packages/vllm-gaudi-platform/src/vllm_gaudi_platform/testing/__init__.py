"""Tiny models built locally for the demo, the tests and the benchmarks: random-weight
architectures (`tinymodels.py`) and a Llama trained on the Python docs (`trainedmodel.py`).
Nothing in the serving path imports this package."""
