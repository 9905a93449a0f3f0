"""The model core: config, tokenizer, BERT model, pooling, task heads, checkpoints, bulk encoding."""
