# ZeRO-3 (FSDP2, block by block) over 2 data replicas x 1D tensor parallelism over 2 ranks.
# torchrun --nproc-per-node 4 examples/hf/train.py --config <this file>
parallel = dict(data=2, tensor=dict(size=2, mode="1d"))
zero = dict(stage=3)
