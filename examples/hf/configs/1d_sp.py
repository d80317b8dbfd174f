# 1D tensor parallelism over 2 ranks with sequence parallelism between blocks.
parallel = dict(tensor=dict(size=2, mode="1d", sequence_parallel=True))
