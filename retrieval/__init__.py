"""twotower.retrieval"""
