"""What every tensor-parallel layer uses, whatever its mode.

The base module and its input checks, the context lookup, parameter creation and description
(``shards``), the weight and bias of every linear layer (``dense``), embedding tables
(``tables``), initializers, autocast inside autograd functions, and the error for a mode
without an implementation. Nothing here knows a mode's layout.
"""
