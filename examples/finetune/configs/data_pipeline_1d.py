# Data x pipeline x 1D: 2 replicas of 2 stages (1F1B, 2 microbatches), each stage split over
# 2 tensor ranks. GPT-2's head, tied to the embedding, sits on the last stage.
# torchrun --nproc-per-node 8 examples/finetune/finetune.py --config <this file>
parallel = dict(data=2, pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 2
