"""``python -m tessera.engine.export CHECKPOINT OUT``: a checkpoint as a plain state dict."""

from __future__ import annotations

import sys

from .checkpoint.export import export_torch_state_dict, main

__all__ = ["export_torch_state_dict", "main"]

if __name__ == "__main__":
    sys.exit(main())
