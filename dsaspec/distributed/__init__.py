"""Tensor parallelism over torch.distributed: the TP group, its all-reduce transports and all-gather."""
