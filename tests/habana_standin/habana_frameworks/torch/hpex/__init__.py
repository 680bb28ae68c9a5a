"""habana_frameworks.torch.hpex: Habana extension kernels."""
