# 2.5D tensor parallelism (Tesseract, Wang et al. 2021): two stacked 2 x 2 meshes (depth 2);
# the batch is split over 4 (depth x rows), the hidden dim over 2.
#   torchrun --nproc-per-node 8 examples/vit/train.py --config examples/vit/configs/2p5d.py
parallel = dict(tensor=dict(size=8, mode="2.5d", depth=2))
