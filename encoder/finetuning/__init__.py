"""Task fine-tuning: classification, token tagging and extractive QA on the encoder."""
