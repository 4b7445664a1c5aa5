"""Paged attention against a per-row reference written out here (each query's visible slots
gathered, softmax over them): the C kernel, the batched torch path and FlexAttention over a
head-major pool (the GPU path), over decode
rows, chunks after a cached prefix, speculative trees, sliding windows, grouped-query heads and
padding rows; slots no query may see are never used (poisoned with NaN); the reference itself
against plain causal attention."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from reclaim.engine.kv_cache import KVPool
from reclaim.models.kernels import flex_paged
from reclaim.models.kernels.paged import (PagedRows, kernel_eligible, kernel_status, paged_attention,
                                          paged_attention_torch)

needs_kernel = pytest.mark.skipif(kernel_status() != "on", reason=f"C kernel {kernel_status()}")

CASES = [  # past, new, window, trees
    ([5], [1], None, None),
    ([0, 17, 40, 300], [1, 3, 7, 1], None, None),
    ([100, 3], [1, 20], 8, None),
    ([30, 9], [5, 4], None, [[-1, 0, 0, 1, 2], None]),
    ([33], [6], 5, [[-1, 0, 1, 0, 3, 3]]),
    ([0], [40], 16, None),
]


def reference(q, k_pool, v_pool, rows: PagedRows, out) -> None:
    """Query by query: the slots it sees (causal or tree, within the window), one softmax."""
    bs = k_pool.shape[3]
    g = q.shape[1] // k_pool.shape[1]
    for r in range(rows.num_rows):
        past = int(rows.past[r])
        for i in range(int(rows.q_start[r]), int(rows.q_end[r])):
            pos, hi = int(rows.q_pos[i]), int(rows.q_hi[i])
            seen = [s for s in range(hi) if (rows.window is None or s > pos - rows.window)
                    and (s < past or not int(rows.tree_row[r]) or bool(rows.tree[i, s - past]))]
            blk = rows.tables[r].long()[torch.tensor(seen) // bs]
            off = torch.tensor(seen) % bs
            k, v = k_pool[blk, :, :, off], v_pool[blk, :, off]  # [S, Hkv, D]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            w = torch.einsum("hd,shd->hs", q[i].double(), k.double()) / q.shape[-1] ** 0.5
            out[i] = torch.einsum("hs,shd->hd", w.softmax(-1), v.double()).to(out.dtype)


_inductor: list[str] = []


def _needs_inductor() -> None:
    """Skip where torch.compile cannot build C++ on this machine at all (no compiler or headers):
    probed with a trivial function, so a failure of FlexAttention itself still fails the test."""
    if not _inductor:
        try:
            torch.compile(lambda x: x.sin() + 1)(torch.ones(3))
            _inductor.append("")
        except Exception as e:  # noqa: BLE001 - any toolchain error
            _inductor.append(f"{type(e).__name__}: {str(e)[:200]}")
    if _inductor[0]:
        pytest.skip(f"torch.compile builds nothing here ({_inductor[0]})")


def shuffled_tables(past: list[int], new: list[int], bs: int, g: torch.Generator, blocks: int = 64) -> list[list[int]]:
    """Block tables for rows of past + new tokens, drawn from the pool's blocks in random order."""
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, i = [], 0
    for p, n in zip(past, new):
        need = -(-(p + n) // bs)
        tables.append(perm[i:i + need])
        i += need
    return tables


def _setup(past, new, window, trees, *, nkv=3, nh=9, d=64, bs=16, seed=0, layout=None):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, 64, bs, nkv, d, layout=layout)
    pool.k[0].normal_(generator=g)
    pool.v[0].normal_(generator=g)
    tables = shuffled_tables(past, new, bs, g)
    view = pool.view(tables, past, new, sliding_window=window, trees=trees)
    view.fresh = []  # every row through the paged path, fresh prompts too
    q = torch.randn(sum(new), nh, d, generator=g)
    return pool, view, q, tables


def _poison_unseen(pool, view, tables, past, new, window, finite=False):
    """NaN in every slot of the rows' blocks that no query of its row may see, and in blocks no
    row holds. finite: 1e4 instead (FlexAttention multiplies a whole tile's values by their
    weights, masked ones 0, and on a CPU its tiles may run past a row's blocks, so a NaN would
    spread; a pool holds zeros or stale K/V, which are finite): a weight above 0 on any of them
    would still show."""
    bs = pool.block_size
    seen = torch.zeros(pool.k[0].shape[0], bs, dtype=torch.bool)
    for tb, p, n in zip(tables, past, new):
        lo = 0 if window is None else max(0, p - window + 1)  # the earliest position any query sees
        for s in range(lo, p + n):
            seen[tb[s // bs], s % bs] = True
    poison = torch.full((pool.k[0].shape[0], bs), 1e4 if finite else float("nan"))
    pool.k[0].copy_(torch.where(~seen[:, None, None, :], poison[:, None, None, :], pool.k[0]))
    pool.v[0].copy_(torch.where(~seen[:, None, :, None], poison[:, None, :, None], pool.v[0]))


SHAPES = [dict(), dict(nkv=2, nh=16, d=128, bs=32), dict(nkv=4, nh=4, d=16)]
# FlexAttention (the path off the CPU) compiles each shape on a CPU: 2.5-5 s with inductor's caches
# warm, 19-23 s on a fresh machine (the first compile), so every flex case runs with -m slow;
# scripts/gpu_check.py runs it on CUDA
PARAMS = [pytest.param(*case, path, shape, marks=[pytest.mark.slow] if path == "flex" else [])
          for path in ("kernel", "torch", "flex") for shape in SHAPES for case in CASES]


@pytest.mark.parametrize("past,new,window,trees,path,shape", PARAMS)
def test_paged_attention_equals_the_reference(past, new, window, trees, shape, path):
    pool, view, q, tables = _setup(past, new, window, trees, **shape, layout="heads" if path == "flex" else None)
    if path == "kernel" and not kernel_eligible(q, pool.k[0]):
        pytest.skip(f"C kernel {kernel_status()}")
    want = torch.zeros_like(q)
    reference(q, pool.k[0], pool.v[0], view.rows, want)
    _poison_unseen(pool, view, tables, past, new, window, finite=path == "flex")
    got = torch.zeros_like(q)
    if path == "flex":  # the pool head-major, as off the CPU: FlexAttention reads it in place
        _needs_inductor()
        assert not kernel_eligible(q, pool.k[0]) and view.rows.flex is not None
        assert flex_paged.paged_attention_flex(q, pool.k[0], pool.v[0], view.rows, got), flex_paged.failed
    else:
        (paged_attention if path == "kernel" else paged_attention_torch)(q, pool.k[0], pool.v[0], view.rows, got)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_the_torch_path_reads_nothing_on_the_host_and_skips_padding_rows():
    """The GPU path: a padded batch (as a captured graph runs it) gives the same rows, and what
    to gather comes from the view (host ints), not from reading the device."""
    pool, _, q, tables = _setup([40, 7], [1, 1], None, None)
    plain = pool.view(tables, [40, 7], [1, 1])
    padded = pool.view(tables, [40, 7], [1, 1], pad_to=4, table_width=8)
    assert padded.rows.num_rows == 4 and (padded.rows.max_new, padded.rows.max_keys) == (1, 8 * 16)
    want, got = torch.zeros_like(q), torch.zeros(4, *q.shape[1:])
    paged_attention_torch(q, pool.k[0], pool.v[0], plain.rows, want)
    with _NoReads():
        paged_attention_torch(torch.cat([q, torch.zeros(2, *q.shape[1:])]), pool.k[0], pool.v[0], padded.rows, got)
    torch.testing.assert_close(got[:2], want, atol=2e-6, rtol=1e-5)


class _NoReads(TorchDispatchMode):
    """Fails on any op that reads a value back to the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func._schema.name.split("::")[-1] not in ("_local_scalar_dense", "nonzero"), func
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window", [None, 5])
def test_reference_equals_causal_attention_over_the_whole_sequence(window):
    """A chunk of 7 new tokens after 20 cached ones sees what full causal attention sees."""
    pool, view, q, tables = _setup([20], [7], window, None, nkv=2, nh=4, d=16)
    bs = pool.block_size
    s = torch.arange(27)
    blk = torch.tensor(tables[0])[s // bs]
    k = pool.k[0][blk, :, :, s % bs].transpose(0, 1)  # [Hkv, 27, D]
    v = pool.v[0][blk, :, s % bs].transpose(0, 1)
    mask = (s[None, :] <= s[20:, None]) & ((s[None, :] > s[20:, None] - window) if window else True)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True).transpose(0, 1)
    got = torch.zeros_like(q)
    reference(q, pool.k[0], pool.v[0], view.rows, got)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_row_gives_the_same_output_alone_or_in_a_batch():
    """Batch invariance: a decode row's output does not depend on the rows beside it."""
    pool, view, q, _ = _setup([40, 300, 7], [1, 1, 4], None, None)
    both = torch.zeros_like(q)
    paged_attention(q, pool.k[0], pool.v[0], view.rows, both)
    alone_view = pool.view([view.rows.tables[0].tolist()], [40], [1])
    alone = torch.zeros_like(q[:1])
    paged_attention(q[:1], pool.k[0], pool.v[0], alone_view.rows, alone)
    assert torch.equal(alone, both[:1])
