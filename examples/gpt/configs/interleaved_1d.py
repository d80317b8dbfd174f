# Interleaved 1F1B x 1D on 4 ranks: 2 pipeline ranks with 2 model chunks each, 1D over 2 ranks.
#   torchrun --nproc-per-node 4 examples/gpt/train.py \
#       --config examples/gpt/configs/interleaved_1d.py
parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 4
num_chunks = 2
