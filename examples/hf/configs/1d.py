# 1D tensor parallelism (Megatron-LM) over 2 ranks.
parallel = dict(tensor=dict(size=2, mode="1d"))
