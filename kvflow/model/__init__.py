"""Model layer: config, weights loading (GGUF / safetensors), tokenizer, block-KV forward pass."""
