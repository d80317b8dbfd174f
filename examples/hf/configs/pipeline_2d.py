# Pipeline x 2D: 2 stages (1F1B, 4 microbatches), each a 2x2 SUMMA mesh (8 ranks).
# torchrun --nproc-per-node 8 examples/hf/train.py --config <this file>
parallel = dict(pipeline=2, tensor=dict(size=4, mode="2d"))
model = dict(kind="llama")
num_microbatches = 4
