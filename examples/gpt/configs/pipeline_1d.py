# Pipeline x 1D tensor parallelism on 4 ranks: 2 stages (1F1B, 4 microbatches), each split
# over 2 tensor ranks; the embedding and the logits are split over the vocabulary.
#   torchrun --nproc-per-node 4 examples/gpt/train.py --config examples/gpt/configs/pipeline_1d.py
parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 4
