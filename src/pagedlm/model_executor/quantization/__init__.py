"""Weight quantization that pagedlm computes itself (bitsandbytes lives in the loader):
FP8 E4M3 weights quantized at load or read from pre-quantized checkpoints (``fp8``,
``fp8_checkpoint``)."""
