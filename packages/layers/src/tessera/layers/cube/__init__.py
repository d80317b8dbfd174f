"""3D tensor parallelism (Bian et al. 2021): the q x q x q cube.

``layout`` (the cube's groups and its two activation layouts), ``matmul`` (the product) and
the layers built on them.
"""
