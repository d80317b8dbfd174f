# 2.5D tensor parallelism (Tesseract): a 2x2 mesh, depth 2.
parallel = dict(tensor=dict(size=8, mode="2.5d", depth=2))
