"""Serving: the OpenAI-compatible HTTP server, its scheduler, sampling, tokenizer, metrics and recording."""
