# Zero-bubble pipeline ZB-H1 (Qi et al. 2023): 1F1B with the backward split into the input
# gradient (B) and the weight gradient (W); deferred W's fill the bubbles.
#   torchrun --nproc-per-node 2 examples/vit/train.py --config examples/vit/configs/zero_bubble.py
parallel = dict(pipeline=2)
schedule = dict(type="ZeroBubbleSchedule", num_microbatches=4)
