# One process, no parallelism.
#   torchrun --nproc-per-node 1 examples/gpt/train.py --config examples/gpt/configs/single.py
parallel = dict()
