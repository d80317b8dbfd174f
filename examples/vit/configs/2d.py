# 2D tensor parallelism (SUMMA, Xu et al. 2021) on a 2 x 2 mesh: every weight and every
# activation is split in both dims; rank (i, j) holds [b/2, tokens, hidden/2].
#   torchrun --nproc-per-node 4 examples/vit/train.py --config examples/vit/configs/2d.py
parallel = dict(tensor=dict(size=4, mode="2d"))
