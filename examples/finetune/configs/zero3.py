# Data parallelism with ZeRO-3 (FSDP2): parameters, gradients and optimizer state sharded
# over the 4 ranks, each block gathered for its forward and backward.
# torchrun --nproc-per-node 4 examples/finetune/finetune.py --config <this file>
parallel = dict(data=4)
zero = dict(stage=3)
