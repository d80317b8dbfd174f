# Data x pipeline x 2D: 2 replicas of 2 stages (1F1B, 4 microbatches), each stage a 2x2 mesh
# (16 ranks). GPT-2's head, tied to the embedding, sits on the last stage of each replica.
# torchrun --nproc-per-node 16 examples/hf/train.py --config <this file>
parallel = dict(data=2, pipeline=2, tensor=dict(size=4, mode="2d"))
model = dict(kind="llama")
num_microbatches = 4
