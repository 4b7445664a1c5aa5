"""The few-row CPU linear kernel (reclaim/models/kernels/small_linear.c) against F.linear."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from reclaim.models.kernels import linear as kl

needs_kernel = pytest.mark.skipif(kl.status() != "on", reason=f"kernel unavailable here: {kl.status()}")


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within fp32 rounding of a dot product of length K (scaled by sum |x_k w_k|)."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= 4e-7 * x.shape[-1] ** 0.5 * scale + 1e-30).all()


@needs_kernel
@pytest.mark.parametrize("k", [1, 5, 16, 33, 576])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_float64_within_rounding_for_every_row_count(k, n, bias):
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for m in range(1, kl.SMALL_ROWS + 1):
        x = torch.randn(m, k, generator=g)
        _close(kl.small_linear(x, w, b), x, w, b)


@needs_kernel
def test_a_row_gives_bitwise_the_same_output_alone_or_among_others():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1538, 576, generator=g), torch.randn(1538, generator=g)
    x = torch.randn(16, 576, generator=g)
    together = kl.small_linear(x, w, b)
    for m in range(16):
        assert torch.equal(kl.small_linear(x[m:m + 1], w, b), together[m:m + 1])
    assert torch.equal(kl.small_linear(x[2:7], w, b), together[2:7])
    assert torch.equal(kl.small_linear(x[5:14], w, b), together[5:14])  # across the 8-row passes


@needs_kernel
def test_the_packed_weights_follow_every_change_of_the_weights():
    """The kernel reads a packed copy of each weight: an in-place write, a fused AdamW step (which
    does not move the version counter), a new `.data` and a sleep's forget_packed all reach it."""
    from reclaim.optim import adamw

    torch.manual_seed(0)
    lin = kl.Linear(96, 200)
    x = torch.randn(3, 96)

    def check():
        with torch.no_grad():
            _close(lin(x), x, lin.weight.detach(), lin.bias.detach())

    check()
    assert hasattr(lin.weight, "_reclaim_packed")
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96))
    check()
    opt = adamw(list(lin.parameters()), lr=0.5)  # (gives the weights storage of their own)
    check()  # packed from that storage
    lin(x).square().sum().backward()
    opt.step()
    check()
    lin.weight.data = torch.randn(200, 96)
    check()
    nbytes = lin.weight._reclaim_packed[1].nbytes
    assert nbytes == 5 * 96 * 48 * 4  # ceil(200 / 48) panels of 48 columns, zeros past 200
    assert kl.forget_packed([lin.weight]) == nbytes and not hasattr(lin.weight, "_reclaim_packed")
    check()


@needs_kernel
def test_threads_split_the_outputs_without_changing_them():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(1030, 200, generator=g), torch.randn(5, 200, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kl.small_linear(x, w)
        torch.set_num_threads(2)
        two = kl.small_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(20, 48, generator=g)
    x = torch.randn(48, 6, generator=g).t()  # [6, 48], last dim not contiguous
    _close(kl.small_linear(x, w), x, w, None)
    x3 = torch.randn(2, 3, 96, generator=g)[..., ::2]  # [2, 3, 48] with stride 2
    got = kl.small_linear(x3, w)
    assert got.shape == (2, 3, 20)
    _close(got.reshape(6, 20), x3.reshape(6, 48), w, None)


@needs_kernel
def test_the_module_takes_the_kernel_only_for_few_row_inference():
    torch.manual_seed(3)
    lin = kl.Linear(32, 24)
    ref = torch.nn.Linear(32, 24)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert kl.eligible(x, lin.weight)
        assert torch.equal(lin(x), kl.small_linear(x, lin.weight, lin.bias))
        assert not kl.eligible(torch.randn(kl.SMALL_ROWS + 1, 32), lin.weight)
        assert not kl.eligible(x.double(), lin.weight)
    # With gradients wanted it is F.linear, bitwise, and gradients flow.
    assert not kl.eligible(x, lin.weight)
    y = lin(x)
    assert torch.equal(y, ref(x))
    y.sum().backward()
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, x.sum(0).expand(24, 32))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_more_rows_of_inference_run_onednn_within_rounding():
    g = torch.Generator().manual_seed(4)
    lin = kl.Linear(576, 130)
    for rows in (kl.SMALL_ROWS + 1, 40, 300):
        x = torch.randn(2, rows, 576, generator=g)
        with torch.no_grad():
            assert kl.onednn_eligible(x, lin.weight) and not kl.eligible(x, lin.weight)
            y = lin(x)
            assert torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, lin.weight, lin.bias, "none", [], ""))
            _close(y, x, lin.weight, lin.bias)
            with kl.torch_kernels():
                assert not kl.onednn_eligible(x, lin.weight)
    assert not kl.onednn_eligible(x, lin.weight)  # training keeps F.linear
    assert not kl.onednn_eligible(x.double(), lin.weight.double())


def test_switched_off_by_the_environment_it_runs_f_linear():
    code = ("from reclaim.models.kernels import linear as kl; import torch;"
            "print(kl.status()); print(kl.eligible(torch.ones(1, 4), torch.ones(2, 4)));"
            "print(kl.onednn_eligible(torch.ones(40, 4), torch.ones(2, 4)))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RECLAIM_SMALL_LINEAR": "0"},
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "off: switched off by RECLAIM_SMALL_LINEAR=0" and out[1] == "False" and out[2] == "False"


@needs_kernel
def test_torch_kernels_turns_the_kernel_off_on_this_thread_only():
    import threading

    x, w = torch.ones(2, 16), torch.ones(4, 16)
    seen = []
    with torch.no_grad(), kl.torch_kernels():
        assert not kl.eligible(x, w)
        with kl.torch_kernels():
            assert not kl.eligible(x, w)
        assert not kl.eligible(x, w)

        def other():
            with torch.no_grad():
                seen.append(kl.eligible(x, w))
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == [True]
    with torch.no_grad():
        assert kl.eligible(x, w)


def test_a_compiler_that_fails_leaves_f_linear_with_a_warning(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "cc").write_text("#!/bin/sh\necho 'cc: no such luck' >&2\nexit 1\n")
    (fake / "cc").chmod(0o755)
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from reclaim.models.kernels import linear as kl; import torch\n"
            "with torch.no_grad(): y = kl.Linear(4, 2)(torch.ones(1, 4))\n"
            "print(kl.status()); print(tuple(y.shape))")
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "RECLAIM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    status, shape = done.stdout.strip().split("\n")
    assert status.startswith("off: could not build the kernel:") and "cc: no such luck" in status
    assert shape == "(1, 2)"
    assert "C kernel small_linear unavailable" in done.stderr
