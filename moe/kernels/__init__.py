"""Triton kernels of the MoE layer beside their host wrappers: router, routed GEMM, launch helpers, plans."""
