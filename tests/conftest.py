import os

import pytest
import torch

# Keep CI's two cores from oversubscribing and make runs repeatable: the cores shared among the
# xdist workers (one thread each with `make test`'s `-n 3` on two cores), at most two.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


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
def built_once(tmp_path_factory, worker_id):
    """built_once(name, build) -> a directory `build(dir)` filled once for the whole test run.

    A module-scoped fixture runs once per xdist worker that runs one of its module's tests; for
    the torchrun runs (15-30 s) that doubled the work whenever the two workers split a module.
    The first worker builds under a lock; the other waits and reuses it (a failed build is
    retried by the next one)."""
    import shutil

    from reclaim.storage import _locked

    base = tmp_path_factory.getbasetemp()
    base = base.parent if worker_id != "master" else base  # the run's directory, shared by its workers

    def get(name: str, build):
        root = base / f"built-{name}"
        with _locked(base / f".built-{name}.lock"):
            if not (root / ".built").exists():
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir()
                build(root)
                (root / ".built").touch()
        return root

    return get


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model (SmolLM2-135M-Instruct) as an HF directory; the first use ever converts
    its GGUF (about 10 s), later ones find it in $RECLAIM_CACHE."""
    from reclaim.models.loading import default_model_dir as find_or_convert

    return find_or_convert()


def _scan_inputs(b=2, t=29, d=5, n=3, dtype=torch.float64):
    import torch.nn.functional as F

    x = torch.randn(b, t, d, dtype=dtype)
    dt = F.softplus(torch.randn(b, t, d, dtype=dtype) - 1)
    A = -torch.rand(d, n, dtype=dtype) * 2 - 0.1
    B, C = torch.randn(b, t, n, dtype=dtype), torch.randn(b, t, n, dtype=dtype)
    h0 = torch.randn(b, d, n, dtype=dtype)
    return [v.requires_grad_() for v in (x, dt, A, B, C, h0)]


@pytest.fixture
def scan_inputs():
    """make(b, t, d, n, dtype) -> [x, dt, A, B, C, h0]: random selective-scan inputs (float64,
    requiring grad) with a stable A < 0 and a softplus-ed dt."""
    return _scan_inputs


def pytest_collection_modifyitems(config, items):
    """Tests marked `launches` (torchrun ranks, a server, the demo: seconds each) run first, in
    their order: xdist's workers then finish with short tests, together, instead of one waiting
    on another's last launch."""
    items.sort(key=lambda item: item.get_closest_marker("launches") is None)
