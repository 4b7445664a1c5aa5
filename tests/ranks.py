"""`ranks(script, *args)`: a test script's ranks started as torchrun starts them, but forked from a
process that imported torch and reclaim once per test worker.

torchrun runs each rank as `python script args` in a fresh interpreter with RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (init_process_group reads them).
Here each rank runs the same script the same way (as `__main__`, its folder first on sys.path, the
same variables, one OpenMP thread), forked from a multiprocessing forkserver that imported PRELOAD
and ran nothing. A torchrun launch spent about 8 s of CPU before any work (torchrun and each rank
importing torch, transformers and reclaim), a fifth of the test suite's CPU over its launches.
The commands users launch (`torchrun ... reclaim serve`, `torchrun ... reclaim.cli ssm-train`) are
still tested under torchrun itself.

A rank's stdout and stderr go to a log (with faulthandler's stacks if it dies on a signal); a rank
that fails or outlives the timeout ends the others, and the assertion shows every rank's log tail.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

# Imported once by the forkserver (imports only: no torch op runs there, so no OpenMP pool is
# forked). A module that fails to import here is imported by the rank itself.
PRELOAD = ["torch", "torch.distributed", "transformers", "reclaim.rl.grpo", "reclaim.ssm.train", "reclaim.fsdp"]


def _rank(script: str, args: list[str], env: dict[str, str], path: list[str], cwd: str, log: str) -> None:
    """A forked rank: `python script *args` in this process, then exit with its status."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import faulthandler
    import runpy
    import traceback

    faulthandler.enable()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    sys.path[:0] = [str(Path(script).parent), *path]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(script: str, *args: str, nproc: int = 2, timeout: float = 600, env: dict[str, str] | None = None,
          path: list[str] | None = None) -> None:
    """Run `script *args` on `nproc` local ranks (gloo's env:// rendezvous on a free port); `env`
    is added to this process's environment, `path` to each rank's sys.path. AssertionError with
    every rank's log tail where a rank exits non-zero or the ranks outlive `timeout` seconds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    base = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    with tempfile.TemporaryDirectory() as logs:
        procs = [ctx.Process(target=_rank, args=(str(script), list(args),
                                                 {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                                 list(path or []), os.getcwd(), f"{logs}/rank{r}.log"))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank failed: the others would wait on it in a collective
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        codes = [p.exitcode for p in procs]
        if codes != [0] * nproc:
            tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{_tail(Path(logs, f'rank{r}.log'))}"
                              for r, c in enumerate(codes))
            timed_out = " (killed at the timeout)" if time.monotonic() >= end else ""
            raise AssertionError(f"{script} on {nproc} ranks: exit codes {codes}{timed_out}\n{tails}")


def _tail(log: Path) -> str:
    if not log.exists():  # multiprocessing's own error, on this process's stderr
        return "(no log: the rank died before its script started)"
    return log.read_text()[-3000:]
