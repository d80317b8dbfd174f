# Data parallelism over 2 ranks (torch DDP): each rank reads 32 of every 64 images.
#   torchrun --nproc-per-node 2 examples/vit/train.py --config examples/vit/configs/data.py
parallel = dict(data=2)
