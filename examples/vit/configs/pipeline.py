# Pipeline parallelism, 2 stages, 1F1B (PipeDream-flush / Megatron-LM) with 4 microbatches.
#   torchrun --nproc-per-node 2 examples/vit/train.py --config examples/vit/configs/pipeline.py
parallel = dict(pipeline=2)
num_microbatches = 4
