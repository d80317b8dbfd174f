# Pipeline x 1D with sequence parallelism: 2 stages (1F1B, 4 microbatches), each split over 2
# tensor ranks that also split the tokens between the first block and the final norm
# (Korthikanti et al. 2022), so the stages send [b, s/2, h] to each other (4 ranks).
# torchrun --nproc-per-node 4 examples/hf/train.py --config <this file>
parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d", sequence_parallel=True))
model = dict(kind="llama")
num_microbatches = 4
