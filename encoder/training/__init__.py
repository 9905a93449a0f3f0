"""Pieces every training loop shares: budgets, optimisers, resumable state, run logs."""
