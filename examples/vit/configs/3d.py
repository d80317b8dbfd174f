# 3D tensor parallelism (Bian et al. 2021) on a 2 x 2 x 2 cube: each rank holds
# [b/4, tokens, hidden/2] and 1/8 of every weight.
#   torchrun --nproc-per-node 8 examples/vit/train.py --config examples/vit/configs/3d.py
parallel = dict(tensor=dict(size=8, mode="3d"))
