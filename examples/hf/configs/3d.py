# 3D tensor parallelism on a 2x2x2 cube.
parallel = dict(tensor=dict(size=8, mode="3d"))
