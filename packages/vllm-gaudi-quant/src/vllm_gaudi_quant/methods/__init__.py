"""Quantization methods: the heavy code behind each hpu_quant_* entry point, imported only when
that entry point registers."""
