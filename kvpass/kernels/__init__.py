"""Triton kernels, each file with its launcher and its plain-torch reference."""
