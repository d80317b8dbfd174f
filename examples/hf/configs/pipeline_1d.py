# Pipeline x 1D: 2 stages (1F1B, 4 microbatches), each split over 2 tensor ranks (4 ranks).
# Pipelines take the Llama (--set model.kind=llama): its head is not tied to its embedding.
parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
model = dict(kind="llama")
NUM_MICRO_BATCHES = 4
