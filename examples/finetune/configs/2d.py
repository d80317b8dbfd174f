# 2D tensor parallelism (SUMMA) on a 2x2 mesh.
# torchrun --nproc-per-node 4 examples/finetune/finetune.py --config <this file>
parallel = dict(tensor=dict(size=4, mode="2d"))
