"""Our C kernels for CPUs: attention, panel linears, fused norm/MLP, the decoder loop over them."""
