# Pipeline x sequence parallelism: 2 stages (1F1B, 4 microbatches), each over 2 ranks that
# split every sequence (ring self-attention), so the stages send this rank's chunk of the
# tokens, [b, s/2, h], and the whole padding mask when there is one (4 ranks).
# torchrun --nproc-per-node 4 examples/hf/train.py --config <this file>
parallel = dict(pipeline=2, tensor=dict(size=2, mode="sequence"))
model = dict(kind="gpt2")
num_microbatches = 4
