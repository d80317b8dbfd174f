# 2.5D tensor parallelism (Tesseract): a 2x2 mesh, depth 2.
# torchrun --nproc-per-node 8 examples/hf/train.py --config <this file>
parallel = dict(tensor=dict(size=8, mode="2.5d", depth=2))
