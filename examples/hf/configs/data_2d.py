# Data parallelism x 2D tensor parallelism: 2 replicas of a 2x2 mesh (8 ranks).
# torchrun --nproc-per-node 8 examples/hf/train.py --config <this file>
parallel = dict(data=2, tensor=dict(size=4, mode="2d"))
