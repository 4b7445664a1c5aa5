"""Kernels the models run: the Mamba scan in plain PyTorch (`scan`), and a C kernel for the
few-row matrix products of decoding on a CPU (`linear`, compiled on first use)."""
