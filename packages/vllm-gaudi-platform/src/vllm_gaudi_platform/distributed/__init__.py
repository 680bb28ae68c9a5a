"""Multi-node execution: preparing vLLM's Ray executor for HPU workers (`ray_cluster.py`). The
device communicator vLLM loads by name stays at `vllm_gaudi_platform.communicator`."""
