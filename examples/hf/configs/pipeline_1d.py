# Pipeline x 1D: 2 stages (1F1B, 4 microbatches), each split over 2 tensor ranks (4 ranks).
# GPT-2 (--set model.kind=gpt2) works too: its head, tied to the embedding, sits on the last
# stage, a copy of the first stage's embedding; the engine sums the two copies' gradients.
# torchrun --nproc-per-node 4 examples/hf/train.py --config <this file>
parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
model = dict(kind="llama")
num_microbatches = 4
