# One process, no parallelism.
parallel = dict()
