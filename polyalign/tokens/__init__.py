"""Text to token ids: tokenizers, training a SentencePiece tokenizer, chat templates (built in and a
checkpoint's own Jinja template)."""
