"""Training the two towers: contrastive dual-encoder training, reranker training, mining, losses.

Inference (``twotower.retrieval``) never imports this package; training imports inference.
"""
