"""Model files (GGUF, safetensors, the local cache) and the hardware's dtype choice."""
