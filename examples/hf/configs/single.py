# One process, no parallelism.
# torchrun --nproc-per-node 1 examples/hf/train.py --config <this file>
parallel = dict()
