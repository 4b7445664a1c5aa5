import pytest
import torch


@pytest.fixture
def float64_transformers(monkeypatch):
    """Call it to make `.float()` and `.to(torch.float32)` leave float64 tensors alone, so that
    transformers' torch path (which casts its scans and norms to float32) runs its own math wholly
    in float64 until the test ends."""

    def enable() -> None:
        float_, to = torch.Tensor.float, torch.Tensor.to

        def float64_float(self, *args, **kwargs):
            return self if self.dtype == torch.float64 else float_(self, *args, **kwargs)

        def float64_to(self, *args, **kwargs):
            if self.dtype == torch.float64 and (torch.float32 in args or kwargs.get("dtype") == torch.float32):
                return self
            return to(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "float", float64_float)
        monkeypatch.setattr(torch.Tensor, "to", float64_to)

    return enable
