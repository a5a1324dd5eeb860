"""Generation: batched sampling with a KV cache, the prompts an external engine would use, and
prediction files."""
