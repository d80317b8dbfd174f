# 1D tensor parallelism over 2 ranks with sequence parallelism between blocks.
# torchrun --nproc-per-node 2 examples/hf/train.py --config <this file>
parallel = dict(tensor=dict(size=2, mode="1d", sequence_parallel=True))
