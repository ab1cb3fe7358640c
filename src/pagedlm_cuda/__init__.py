"""pagedlm's NVIDIA CUDA platform (Triton kernels and CUDA graphs come with its backend)."""
