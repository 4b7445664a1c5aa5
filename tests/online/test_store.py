"""The record store: budgets, offload to host, oldest-first eviction, statuses and metrics."""

from __future__ import annotations

from online_helpers import grads, rel_err, tiny_model, token_lists

from reclaim.online.recorder import record_prompt, recompute_loss, reuse_loss
from reclaim.online.store import RecordStore


def records(model, n, plen=8, version=0):
    return [record_prompt(model, p, response_id=f"r{i}", version=version)
            for i, p in enumerate(token_lists([plen] * n, seed=7))]


def test_oldest_records_are_evicted_first():
    model = tiny_model()
    recs = records(model, 4)
    size = recs[0].nbytes
    store = RecordStore(record_budget=2 * size + 1, record_host_budget=0)
    for r in recs:
        assert store.put(r)
    m = store.metrics()
    assert (m["records"], m["evictions"], m["bytes"]) == (2, 2, 2 * size)
    assert [store.info(f"r{i}").status for i in range(4)] == ["evicted", "evicted", "present",
                                                             "present"]
    assert store.info("never").status == "missing"
    assert store.take("r0", version=0) == (None, "evicted")
    assert store.take("nope", version=0) == (None, "missing")
    assert store.metrics()["misses"] == 2


def test_over_budget_records_go_to_host_then_oldest_host_records_are_evicted():
    """Forced budgets: one record on the device, two on the host. On a CPU the records already
    are in host memory: offloading accounts them to the host budget and copies nothing (the copy
    itself, for a record on another device, is tested with PromptRecord.offload)."""
    model = tiny_model()
    recs = records(model, 4)
    size = recs[0].nbytes
    store = RecordStore(record_budget=size, record_host_budget=2 * size)
    for r in recs:
        store.put(r)
    where = [store.info(f"r{i}").where for i in range(4)]
    assert where == [None, "host", "host", "device"]
    m = store.metrics()
    assert (m["device_bytes"], m["host_bytes"], m["offloads"], m["evictions"]) == (
        size, 2 * size, 3, 1)
    assert all(s.tensor is not None and s.host is None for s in recs[1].saved)


def test_an_offloaded_record_still_gives_the_exact_gradient():
    model = tiny_model("qwen2")
    prompt, resp = token_lists([9], seed=3)[0], token_lists([5], seed=4)[0]
    loss, n = recompute_loss(model, [prompt], [resp])
    (loss / n).backward()
    want = grads(model).clone()
    model.zero_grad(set_to_none=True)
    first = record_prompt(model, prompt, response_id="a", version=0)
    store = RecordStore(record_budget=first.nbytes, record_host_budget=10 * first.nbytes)
    store.put(first)
    store.put(record_prompt(model, [5, 6, 7, 8, 9, 10, 11, 12, 13], response_id="b", version=0))
    rec, status = store.take("a", version=0)
    assert (status, rec.where) == ("hit", "host")
    loss, n = reuse_loss(model, [rec], [resp])
    (loss / n).backward()
    assert rel_err(grads(model), want) <= 1e-5


def test_a_stale_record_is_never_handed_out_at_max_staleness_zero():
    model = tiny_model()
    (rec,) = records(model, 1, version=3)
    store = RecordStore()
    store.put(rec)
    assert store.take("r0", version=4, max_staleness=0) == (None, "stale")
    assert store.info("r0").status == "stale"
    assert store.metrics()["stale"] == 1 and store.metrics()["records"] == 0
    store.put(rec)
    got, status = store.take("r0", version=4, max_staleness=1)
    assert got is rec and status == "hit_stale"
    store.put(rec)
    assert store.drop_older_than(4) == 1 and store.info("r0").status == "stale"


def test_a_record_too_big_for_both_budgets_is_refused_and_counted():
    model = tiny_model()
    (rec,) = records(model, 1)
    store = RecordStore(record_budget=10, record_host_budget=10)
    assert not store.put(rec)
    assert store.metrics()["rejected"] == 1 and store.info("r0").status == "evicted"
