"""tessera's named registries: no torch at import, torch's classes as lazy fallbacks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tessera.registry import LOSSES, LR_SCHEDULERS, OPTIMIZERS, Registry


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_import_does_not_import_torch() -> None:
    result = run_python("import tessera.registry, sys; assert 'torch' not in sys.modules")
    assert result.returncode == 0, result.stderr


def test_registration_and_other_registries_do_not_import_torch() -> None:
    result = run_python(
        """
        import sys
        from tessera.registry import LAYERS, OPTIMIZERS, Config, build

        @OPTIMIZERS.register(name="MyOpt")
        class MyOpt:
            def __init__(self, lr):
                self.lr = lr

        assert OPTIMIZERS.get("MyOpt") is MyOpt      # found before the fallback is needed
        assert "MyOpt" in OPTIMIZERS
        assert build({"type": "MyOpt", "lr": 2}, OPTIMIZERS).lr == 2
        LAYERS.names()
        Config({"a": {"b": 1}}).apply_overrides(["a.b=2"])
        assert "torch" not in sys.modules, "torch imported too early"
        assert OPTIMIZERS.get("Adam").__name__ == "Adam"  # first miss imports torch
        assert "torch" in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


def test_optimizers_know_torch_optimizers() -> None:
    assert OPTIMIZERS.get("Adam") is torch.optim.Adam
    assert OPTIMIZERS.get("SGD") is torch.optim.SGD
    assert OPTIMIZERS.get("AdamW") is torch.optim.AdamW
    assert "Adam" in OPTIMIZERS
    assert "Optimizer" not in OPTIMIZERS  # the abstract base is not a choice
    assert "lr_scheduler" not in OPTIMIZERS
    assert {"Adam", "SGD", "RMSprop"} <= set(OPTIMIZERS.names())


def test_lr_schedulers_know_torch_schedulers() -> None:
    assert LR_SCHEDULERS.get("CosineAnnealingLR") is torch.optim.lr_scheduler.CosineAnnealingLR
    assert LR_SCHEDULERS.get("StepLR") is torch.optim.lr_scheduler.StepLR
    assert "ReduceLROnPlateau" in LR_SCHEDULERS
    assert "LRScheduler" not in LR_SCHEDULERS


def test_losses_know_torch_losses() -> None:
    assert LOSSES.get("CrossEntropyLoss") is torch.nn.CrossEntropyLoss
    assert LOSSES.get("MSELoss") is torch.nn.MSELoss
    assert all(name.endswith("Loss") for name in LOSSES.names() if name in dir(torch.nn))


def test_torch_name_typo_suggests_torch_class() -> None:
    with pytest.raises(
        KeyError, match=r"registry 'optimizers' has no name 'Adamm'; did you mean 'Adam'"
    ):
        OPTIMIZERS.get("Adamm")


def test_registration_shadows_torch_fallback() -> None:
    reg: Registry[object] = Registry("optimizers", fallback=lambda: {"Adam": torch.optim.Adam})

    class Adam:
        pass

    reg.register(Adam)
    assert reg.get("Adam") is Adam
