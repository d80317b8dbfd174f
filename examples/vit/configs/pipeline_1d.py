# A 4-rank hybrid: pipeline 2 (1F1B, 4 microbatches) x 1D tensor 2 (Megatron-LM). Small enough
# for the multi-node and elastic-restart tests (tests_integration/).
# Global rank = stage * 2 + tensor.
#   torchrun --nproc-per-node 4 examples/vit/train.py --config examples/vit/configs/pipeline_1d.py
parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
num_microbatches = 4
