"""``python -m tessera.engine.export CHECKPOINT OUT``: a checkpoint as a plain state dict.

With ``--config FOLDER``: as a transformers checkpoint folder (``export_pretrained``).
"""

from __future__ import annotations

import sys

from .checkpoint.export import export_pretrained, export_torch_state_dict, main

__all__ = ["export_pretrained", "export_torch_state_dict", "main"]

if __name__ == "__main__":
    sys.exit(main())
