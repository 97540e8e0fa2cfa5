"""Benchmark harness: prompt sets, Hugging Face baselines, and the vLLM CPU peer (see README.md)."""
