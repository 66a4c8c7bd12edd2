"""Comparison-only kernels: what serving engines run today, kept so every benchmark and test can put
the shipped path beside them. Nothing in the runtime's default path imports them.

- :mod:`.dsa_metadata`: context-wide replay metadata (SGLang's production grid with its early return).
- :mod:`.draft_decode_metadata`: the multi-step draft precompute into a scratch set plus copies.
"""
