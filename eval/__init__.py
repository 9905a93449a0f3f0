"""twotower.eval"""
