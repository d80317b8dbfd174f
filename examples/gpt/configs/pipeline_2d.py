# Pipeline x 2D tensor parallelism on 8 ranks: 2 stages (1F1B, 4 microbatches), each a 2 x 2
# SUMMA mesh; vocab-parallel embedding and logits split the vocabulary over the mesh.
#   torchrun --nproc-per-node 8 examples/gpt/train.py --config examples/gpt/configs/pipeline_2d.py
parallel = dict(pipeline=2, tensor=dict(size=4, mode="2d"))
num_microbatches = 4
