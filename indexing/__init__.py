"""twotower.indexing"""
