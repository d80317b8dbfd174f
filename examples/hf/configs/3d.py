# 3D tensor parallelism on a 2x2x2 cube.
# torchrun --nproc-per-node 8 examples/hf/train.py --config <this file>
parallel = dict(tensor=dict(size=8, mode="3d"))
