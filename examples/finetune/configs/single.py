# One process, no parallelism: the reference the parallel fine-tunes are compared with.
# torchrun --nproc-per-node 1 examples/finetune/finetune.py --config <this file>
parallel = dict()
