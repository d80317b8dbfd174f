"""Pieces the ViT and GPT examples share: a transformer block and the launch/result plumbing.

Everything here is written with tessera's mode-dispatching layers only, so the same code runs
single-process, data parallel, with 1D, 2D, 2.5D, 3D tensor parallelism, with sequence
parallelism and inside a pipeline stage.
"""
