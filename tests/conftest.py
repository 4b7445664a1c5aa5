import os

import pytest
import torch

# Keep CI's two cores from oversubscribing and make runs repeatable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
