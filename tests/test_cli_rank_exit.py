"""The `reclaim` command as a torchrun rank (WORLD_SIZE above 1) ends without interpreter
finalization (reclaim/cli.py main): its exit code and error line are the command's, and atexit
handlers still run. (A tensor-parallel server's rank 0 aborted in finalization after draining:
tests/server/test_tensor_parallel_serving.py runs that under torchrun.)"""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import atexit, sys
mark = sys.argv[1]
atexit.register(lambda: open(mark, "w").write("atexit ran"))
sys.argv = ["reclaim", *sys.argv[2:]]
from reclaim.cli import main
main()
"""


def _rank(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    mark = tmp_path / "atexit"
    done = subprocess.run([sys.executable, "-c", CODE, str(mark), *args], capture_output=True, text=True,
                          env={**os.environ, "WORLD_SIZE": "2"}, timeout=120, cwd=tmp_path)
    return done, mark.read_text() if mark.exists() else ""


def test_a_rank_keeps_the_commands_exit_code_error_and_atexit(tmp_path):
    done, mark = _rank(tmp_path, "generate", "Hi", "-m", str(tmp_path / "no-such-model"))
    assert done.returncode == 1, done.stderr
    assert "no-such-model" in done.stderr and "Traceback" not in done.stderr
    assert mark == "atexit ran"
    done, mark = _rank(tmp_path, "--help")
    assert done.returncode == 0 and "Usage" in done.stdout and mark == "atexit ran"
