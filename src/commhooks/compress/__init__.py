"""The compression math, free of torch.distributed: low rank, block quantization, packing,
error feedback and the kernels (C on a CPU, Triton on a GPU)."""
