"""Speculative-decoding components: vocab-parallel LM head, LogitsProcessor, greedy draft step."""
