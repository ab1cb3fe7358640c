"""pagedlm's AMD ROCm platform (reuses the Triton kernels; untested on AMD hardware)."""
