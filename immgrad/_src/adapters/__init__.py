"""The model-library adapters, side by side: one module per library and
what they share (``common.py``); each imports the core, never the reverse.
"""
