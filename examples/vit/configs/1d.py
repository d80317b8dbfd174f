# 1D tensor parallelism (Megatron-LM) over 2 ranks: qkv and fc1 split their outputs, proj and
# fc2 their inputs; activations between blocks are replicated.
#   torchrun --nproc-per-node 2 examples/vit/train.py --config examples/vit/configs/1d.py
parallel = dict(tensor=dict(size=2, mode="1d"))
