# 2D tensor parallelism (SUMMA) on a 2x2 mesh.
parallel = dict(tensor=dict(size=4, mode="2d"))
