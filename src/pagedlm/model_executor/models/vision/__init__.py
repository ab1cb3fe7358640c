"""Vision encoders of the vision-language models (no KV cache: each image is one
sequence, attended bidirectionally with SDPA)."""
