# Pipeline x 2D on 8 ranks: a 2-stage 1F1B pipeline whose stages are 2D tensor parallel on a
# 2 x 2 mesh (the README's example block).
#   torchrun --nproc-per-node 8 examples/vit/train.py --config examples/vit/configs/pipeline_2d.py
parallel = dict(pipeline=2, tensor=dict(size=4, mode="2d"))
num_microbatches = 4
