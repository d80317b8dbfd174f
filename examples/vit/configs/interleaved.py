# Interleaved 1F1B (Narayanan et al. 2021): 2 pipeline ranks, 2 model chunks each (4 virtual
# stages: rank 0 holds the stem and block 1, rank 1 block 0 and the head).
#   torchrun --nproc-per-node 2 examples/vit/train.py --config examples/vit/configs/interleaved.py
parallel = dict(pipeline=2)
num_microbatches = 4
num_chunks = 2
