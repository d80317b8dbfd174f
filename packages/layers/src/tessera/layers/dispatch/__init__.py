"""The mode-dispatching layers (``Linear``, ``LayerNorm``, ...) and each mode's builders.

Every other folder holds one mode family; this one is where they meet.
"""
