# Sequence parallelism (Li et al. 2021) over 2 ranks: each rank holds 8 of the 16 patch tokens
# of every image and all weights; attention is ring self-attention.
#   torchrun --nproc-per-node 2 examples/vit/train.py --config examples/vit/configs/sequence.py
parallel = dict(tensor=dict(size=2, mode="sequence"))
