"""habana_frameworks.torch.utils: the `experimental` module neural-compressor reads."""
