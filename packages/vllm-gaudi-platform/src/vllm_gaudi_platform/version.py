"""The one version of the four vllm-gaudi wheels.

Every member's pyproject reads it (`[tool.hatch.version] path`), so the wheels are always released
together at this version; the siblings pin `vllm-gaudi-platform==` it (checked by
tests/packaging). Change it here and in those pins, nowhere else.
"""

__version__ = "0.1.0"
