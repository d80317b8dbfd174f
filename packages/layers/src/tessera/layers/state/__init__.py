"""Full (single-process) state dicts of tensor-parallel modules, and how full forms map back."""
