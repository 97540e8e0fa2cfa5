"""CUDA graphs over the runner's decoding and verify steps."""
