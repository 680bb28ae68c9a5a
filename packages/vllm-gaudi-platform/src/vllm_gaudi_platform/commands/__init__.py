"""The jobs of the `vllm-gaudi` command (its parser and entry point are `vllm_gaudi_platform.cli`):
`doctor`, `demo`, and the third-party start-up messages the command filters out. The calibrate
and proxy commands live in their own wheels (vllm-gaudi-quant, vllm-gaudi-connectors)."""
