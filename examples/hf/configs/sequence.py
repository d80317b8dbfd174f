# Sequence parallelism: ring self-attention over 2 ranks.
# torchrun --nproc-per-node 2 examples/hf/train.py --config <this file>
parallel = dict(tensor=dict(size=2, mode="sequence"))
