"""Communication: plain collectives, autograd ops with exact backward, transfers in flight.

``collectives`` (blocking, no autograd, with the size checks before them), ``ops`` (each
collective as an autograd function over one group) and ``inflight`` (collectives posted now
and waited for later, moved the fastest way the backend offers).
"""
