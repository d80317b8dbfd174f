# Data x pipeline x 2D on 16 ranks: 2 replicas, each a 2-stage 1F1B pipeline whose stages are
# 2D tensor parallel on a 2 x 2 mesh. Global rank = data * 8 + stage * 4 + tensor.
#   torchrun --nproc-per-node 16 examples/vit/train.py --config examples/vit/configs/hybrid_2d.py
parallel = dict(data=2, pipeline=2, tensor=dict(size=4, mode="2d"))
num_microbatches = 4
