"""Configuration: the model config (HF ``config.json`` fields and presets) and the runtime options."""
