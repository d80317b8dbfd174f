# One process, no parallelism: the reference every other layout is compared with.
#   torchrun --nproc-per-node 1 examples/vit/train.py --config examples/vit/configs/single.py
parallel = dict()
