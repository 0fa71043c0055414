"""Corpora, the SentencePiece tokenizer, token shards and the distributed, resumable loader."""
