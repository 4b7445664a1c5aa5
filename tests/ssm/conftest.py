import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from a second intra-op thread; on a busy CPU it stalls them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
