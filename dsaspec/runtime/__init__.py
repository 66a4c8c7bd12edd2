"""The compact DSA runtime: model config, the DSA model with its MTP layer, KV memory, the
safetensors loader (the engine and graph runners build on these)."""
