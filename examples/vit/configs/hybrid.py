# The demo's hybrid: data x pipeline x tensor on 8 ranks: 2 data-parallel replicas, each a
# 2-stage 1F1B pipeline whose stages are 1D tensor parallel over 2 ranks.
# Global rank = data * 4 + stage * 2 + tensor.
#   torchrun --nproc-per-node 8 examples/vit/train.py --config examples/vit/configs/hybrid.py
parallel = dict(data=2, pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 4
