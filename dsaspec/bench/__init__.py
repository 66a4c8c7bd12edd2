"""Benchmark commands (``dsaspec bench NAME``). Each writes JSON + Markdown (+ PNG) results."""
