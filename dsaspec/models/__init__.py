"""Models: the DSA decoder with its MTP layer, and the safetensors checkpoint loader."""
