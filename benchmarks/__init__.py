"""Side-by-side benchmarks (ratios measured in one run) and the models they share
(`_roofline_model.py`, the bucketing simulator in `bucketing.py`). A package, so that the tests
import what they check (`from benchmarks import bucketing`); each benchmark runs as
`python -m benchmarks.<name>` from the repository root (`make bench` runs them all)."""
