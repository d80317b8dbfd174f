# Sequence parallelism: ring self-attention over 2 ranks.
parallel = dict(tensor=dict(size=2, mode="sequence"))
