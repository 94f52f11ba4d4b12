"""The decode engine: the MoE layer over the slot cache, its backends, CUDA graphs, and model loading."""
