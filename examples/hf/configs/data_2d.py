# Data parallelism x 2D tensor parallelism: 2 replicas of a 2x2 mesh (8 ranks).
parallel = dict(data=2, tensor=dict(size=4, mode="2d"))
