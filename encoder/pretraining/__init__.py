"""MLM (+ optional NSP) pretraining: masking, the pretraining model, its data and its loop."""
