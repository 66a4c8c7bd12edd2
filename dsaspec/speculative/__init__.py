"""Speculative decoding (MTP / EAGLE chain): the worker that runs one iteration from CUDA graphs, greedy acceptance, and the draft step."""
