"""The model math: the forward pass, its blocks, KV caches, tokenizer, sampling, generation."""
