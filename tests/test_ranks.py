"""tests/ranks.py, the launcher of the distributed tests: a script's ranks see what torchrun gives
them and reduce over gloo; a rank that fails ends the run with its traceback at once, though its
peer waits in a collective; ranks that outlive the timeout are killed."""

from __future__ import annotations

import json
import time

import pytest

from ranks import ranks

pytestmark = pytest.mark.launches

SCRIPT = '''
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
out = {"name": __name__, "argv": sys.argv[1:], "rank": rank, "world": dist.get_world_size(), "sum": x.item(),
       "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")},
       "threads": torch.get_num_threads(), "cwd": os.getcwd(), "extra": os.environ.get("EXTRA")}
if sys.argv[2] == "fail" and rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
if sys.argv[2] == "fail":
    dist.barrier()  # rank 0 waits here for a rank that never comes
if sys.argv[2] == "hang":
    import time
    time.sleep(600)
open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w").write(json.dumps(out))
dist.destroy_process_group()
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


def test_ranks_see_what_torchrun_gives_and_reduce(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ranks(str(script), str(tmp_path), "ok", nproc=3, env={"EXTRA": "given"}, timeout=120)
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["name"] == "__main__" and got["argv"] == [str(tmp_path), "ok"]
        assert got["rank"] == r and got["world"] == 3 and got["sum"] == 6.0
        assert got["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                              "OMP_NUM_THREADS": "1"}
        assert got["threads"] == 1 and got["cwd"] == str(tmp_path) and got["extra"] == "given"


def test_a_failing_rank_ends_the_run_with_its_traceback(script, tmp_path):
    t = time.monotonic()
    with pytest.raises(AssertionError) as e:
        ranks(str(script), str(tmp_path), "fail", timeout=120)
    assert time.monotonic() - t < 60  # rank 0 waited in the barrier: it was killed, not waited for
    assert "exit codes" in str(e.value) and "RuntimeError: rank 1 fails on purpose" in str(e.value)


def test_ranks_past_the_timeout_are_killed(script, tmp_path):
    with pytest.raises(AssertionError, match="killed at the timeout"):
        ranks(str(script), str(tmp_path), "hang", nproc=1, timeout=3)
