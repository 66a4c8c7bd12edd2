"""Layers of the DSA model: linear (tensor-parallel), vocab-parallel embedding and LM head, norms, RoPE, the dense MLP, the logits processor, and DSA attention (``layers.attention``)."""
