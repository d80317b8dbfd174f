"""2D (SUMMA, Xu et al. 2021) and 2.5D (Tesseract, Wang et al. 2021): the q x q (x depth) mesh.

``layout`` (the mesh's groups and activation blocks), ``summa`` and ``matmul`` (the products),
and the layers built on them.
"""
