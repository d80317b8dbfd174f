# 1D tensor parallelism (Megatron-LM) over 2 ranks.
# torchrun --nproc-per-node 2 examples/hf/train.py --config <this file>
parallel = dict(tensor=dict(size=2, mode="1d"))
