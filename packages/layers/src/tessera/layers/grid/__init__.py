"""What 2D, 2.5D (the mesh) and 3D (the cube) share, written once on a :class:`Grid`.

A grid names which of its groups splits the batch, the hidden dim and the tables; the
embedding, classifier, loss and LayerNorm built on it serve both families.
"""
