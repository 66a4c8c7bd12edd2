"""Triton kernels and thin host wrappers: pure functions on tensors, no engine state."""
