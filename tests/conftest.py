import os

import pytest
import torch

# Keep CI's two cores from oversubscribing and make runs repeatable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from a second intra-op thread; on a busy CPU it stalls them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model (SmolLM2-135M-Instruct) as an HF directory; the first use ever converts
    its GGUF (about a minute), later ones find it in $RECLAIM_CACHE."""
    from reclaim.models.loading import default_model_dir as find_or_convert

    return find_or_convert()
