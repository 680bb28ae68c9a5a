"""KV connectors for vLLM on the HPU platform (see the README): NIXL for disaggregated prefill
and decode (`nixl.py`), KV offloading to host memory and disk (`offload.py`), the P/D proxy
(`proxy.py`). The entry points are in `register.py`."""
