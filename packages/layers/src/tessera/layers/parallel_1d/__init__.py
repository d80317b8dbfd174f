"""1D tensor parallelism (Megatron-LM, Shoeybi et al. 2019): one dimension split over p ranks.

Column- and row-parallel linear layers, embeddings split by dim or by vocabulary, the norm,
classifier heads, dropout and patch embedding, and the vocabulary-parallel cross-entropy and
accuracy.
"""
