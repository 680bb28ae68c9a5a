"""habana_frameworks.torch.distributed: the collectives backend "hccl" (`hccl.py`)."""
