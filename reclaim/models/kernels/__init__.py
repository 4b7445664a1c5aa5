"""Kernels the models run: plain PyTorch references today, faster ones (Triton) beside them later."""
