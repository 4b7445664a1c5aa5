"""`serve --learn` as a team would run it: feedback only as JSON (415 otherwise: a web page can
POST text/plain without a preflight), only from the API key that asked for the response or the
admin key (403), at most N a minute per key (429 + Retry-After); GET /v1/weights lists the
versions, POST /v1/weights/rollback (admin key only) restores one bit for bit and rejects the
feedback trained after it, 404 naming the versions kept for one that is not."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from live_server import start_server
from reclaim.online.trainer import OnlineTrainConfig

USER1, USER2, ADMIN = "sk-user-1", "sk-user-2", "sk-admin"


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def learning(tmp_path_factory):
    out = tmp_path_factory.mktemp("online")
    cfg = OnlineTrainConfig(output_dir=str(out / "{model}"), per_device_train_batch_size=1,
                            learning_rate=1e-2, cost_model="recompute", save_steps=0, keep_versions=3)
    live = start_server(api_key=f"{USER1},{USER2}", admin_key=ADMIN, learn=cfg, feedback_rate_limit=4)
    live.initial = {n: p.detach().clone() for n, p in live.model.named_parameters()}
    live.out = out
    yield live
    live.stop()


def served(http: httpx.Client, key: str) -> str:
    r = http.post("/v1/completions", headers=auth(key),
                  json={"prompt": "Hello", "max_tokens": 3, "temperature": 0.0})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def wait(cond, timeout=60.0):
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout, "timed out"
        time.sleep(0.05)


def test_feedback_must_be_json_from_the_key_that_asked_within_its_rate(learning):
    with httpx.Client(base_url=learning.url, timeout=60) as http:
        rid = served(http, USER1)
        body = f'{{"response_id": "{rid}", "rating": 0}}'
        for headers in ({"Content-Type": "text/plain"}, {},
                        {"Content-Type": "application/x-www-form-urlencoded"}):
            r = http.post("/v1/feedback", content=body, headers={**auth(USER1), **headers})
            assert r.status_code == 415, (headers, r.text)
            assert "application/json" in r.json()["error"]["message"]
        r = http.post("/v1/feedback", headers=auth(USER2), json={"response_id": rid, "rating": 0})
        assert r.status_code == 403 and "another API key" in r.json()["error"]["message"], r.text
        assert http.post("/v1/feedback", json={"response_id": rid, "rating": 0}).status_code == 401
        for key in (USER1, ADMIN):  # the owner, and the admin key
            r = http.post("/v1/feedback", headers=auth(key), json={"response_id": rid, "rating": 0})
            assert r.status_code == 200, r.text
        assert learning.runner.learner.learner.log.response(rid).owner.startswith("key-")
        # USER1 has used 1 of its 4 a minute (a 415 is refused before it counts)
        codes = [http.post("/v1/feedback", headers=auth(USER1), json={"response_id": rid, "rating": 0}
                           ).status_code for _ in range(5)]
        assert codes == [200, 200, 200, 429, 429]
        r = http.post("/v1/feedback", headers=auth(USER1), json={"response_id": rid, "rating": 0})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert "at most 4 a minute" in r.json()["error"]["message"]
        r = http.post("/v1/feedback", headers=auth(ADMIN), json={"response_id": rid, "rating": 0})
        assert r.status_code == 200  # the admin key is not limited; other keys have their own


def test_weights_list_and_rollback(learning):
    engine = learning.runner.engine
    with httpx.Client(base_url=learning.url, timeout=60) as http:
        rid = served(http, USER2)
        start = engine.weights_version
        assert start == 0  # ratings of 0 are stored, not trained on
        r = http.post("/v1/feedback", headers=auth(USER2),
                      json={"response_id": rid, "rating": 1, "correction": "banana banana"})
        assert r.status_code == 200, r.text
        wait(lambda: engine.weights_version == start + 1)
        listed = http.get("/v1/weights", headers=auth(USER2)).json()
        assert listed["current"] == start + 1
        assert [(v["version"], v["parent"], v["kept"], v["current"]) for v in listed["data"]] == [
            (0, None, "memory", False), (1, 0, "memory", True)]

        ask = {"version": 0}
        r = http.post("/v1/weights/rollback", headers=auth(USER1), json=ask)
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
        r = http.post("/v1/weights/rollback", headers=auth(ADMIN), content='{"version": 0}')
        assert r.status_code == 415
        r = http.post("/v1/weights/rollback", headers=auth(ADMIN), json={"version": 99})
        assert r.status_code == 404 and r.json()["error"]["param"] == "version"
        assert "version 99 is not kept; kept: [0, 1]" in r.json()["error"]["message"]
        assert http.post("/v1/weights/rollback", headers=auth(ADMIN),
                         json={"version": "0"}).status_code == 400
        r = http.post("/v1/weights/rollback", headers=auth(ADMIN), json=ask)
        assert r.status_code == 200, r.text
        assert r.json()["undone"] == [1] and r.json()["weights_version"] == 0
        assert engine.weights_version == 0
        for name, p in learning.model.named_parameters():
            assert torch.equal(p, learning.initial[name]), name  # every bit of version 0
        log = learning.runner.learner.learner.log
        assert all(f.rejected == "rollback" for f in log.all() if f.trained_at_step is not None)
        assert log.pending() == []  # rejected, not reopened
        after = http.post("/v1/completions", headers=auth(USER1),
                          json={"prompt": "Hello", "max_tokens": 3, "temperature": 0.0}).json()
        assert after["weights_version"] == 0
        listed = http.get("/v1/weights", headers=auth(ADMIN)).json()
        assert listed["current"] == 0 and {v["reason"] for v in listed["rejected"]} == {"rollback"}
    assert (learning.out / "tiny-llama" / "feedback.db").exists()  # output_dir keyed by the model


def test_without_an_admin_key_there_is_no_rollback(tmp_path):
    cfg = OnlineTrainConfig(output_dir=str(tmp_path), cost_model="recompute")
    live = start_server(learn=cfg)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            r = http.post("/v1/weights/rollback", json={"version": 0})
            assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
            assert http.get("/v1/weights").json()["data"] == [
                {"object": "weights.version", "version": 0, "parent": None, "kept": None, "current": True}]
    finally:
        live.stop()
