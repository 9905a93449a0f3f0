"""twotower.common: plumbing every package shares — atomic writes, device and precision, the heap, ranks.

Neutral ground: ``encoder``, ``indexing``, ``retrieval`` and ``eval`` may all import it; it imports
none of them.
"""
