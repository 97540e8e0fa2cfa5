"""Kernels the runner may use: FlexAttention, our CPU kernels, CUDA graphs."""
