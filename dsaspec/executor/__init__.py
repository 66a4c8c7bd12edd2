"""The model executor: CUDA graphs per batch bucket and the plain greedy decode worker."""
