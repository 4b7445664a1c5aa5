"""The `reclaim` command re-executes itself once with glibc's malloc tunables (reclaim/hugepages.py):
same pid, the missing tunables added to what GLIBC_TUNABLES had, off with RECLAIM_HUGEPAGES=0; fresh
tensor memory then costs far fewer page faults, and freed memory is reused without any."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reclaim import hugepages

SHOW = ("import os, reclaim.hugepages as h; print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), flush=True); "
        "h.enable(); print(os.getpid(), os.environ.get('GLIBC_TUNABLES'))")
glibc = pytest.mark.skipif(not hugepages.missing({}), reason="not Linux with glibc")
ALL = ":".join(hugepages.TUNABLES)


def _run(code: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "RECLAIM_HUGEPAGES")}
    out = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.splitlines()


@glibc
def test_the_command_runs_again_with_the_tunable_in_the_same_process():
    lines = _run(SHOW, GLIBC_TUNABLES="glibc.malloc.trim_threshold=4096")
    # printed before enable(), then by the process it re-executed (before and after its enable());
    # the trim threshold the caller set is kept, the other two added
    pid = lines[0].split()[0]
    assert lines == [f"{pid} glibc.malloc.trim_threshold=4096"] + 2 * [
        f"{pid} glibc.malloc.trim_threshold=4096:{hugepages.TUNABLES[0]}:{hugepages.TUNABLES[1]}"]


@glibc
def test_off_or_already_set_it_runs_once():
    assert len(_run(SHOW, RECLAIM_HUGEPAGES="0")) == 2
    assert _run(SHOW, GLIBC_TUNABLES=ALL)[1].endswith(f" {ALL}") and len(_run(SHOW, GLIBC_TUNABLES=ALL)) == 2
    assert hugepages.missing({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == list(hugepages.TUNABLES[1:])


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


madvise_thp = pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                                 reason="transparent huge pages not on request (madvise) here: "
                                        "plain malloc would fault as little or as much")


@pytest.mark.slow
@glibc
@madvise_thp
def test_fresh_tensor_memory_faults_far_less():
    touch = ("import resource, torch; f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; "
             "x = torch.empty(2**26); x.fill_(1.0); "
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)")
    plain = int(_run(touch, RECLAIM_HUGEPAGES="0")[-1])
    huge = int(_run("import reclaim.hugepages as h; h.enable()\n" + touch)[-1])
    assert plain > 60_000 and huge * 10 < plain, (plain, huge)  # 256 MiB: 65,536 pages of 4 KiB


@pytest.mark.slow
@glibc
@madvise_thp
def test_freed_memory_is_reused_without_faults():
    """Blocks under 32 MiB freed by one forward are there for the next one: 64 MiB of 16 MiB
    tensors allocated, freed and allocated again faults the second time only without the tunables."""
    again = ("import resource, torch\n"
             "def touch():\n    xs = [torch.empty(2**22) for _ in range(4)]\n    [x.fill_(1.0) for x in xs]\n"
             "touch()\nf = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\ntouch()\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)")
    plain = int(_run(again, RECLAIM_HUGEPAGES="0")[-1])
    kept = int(_run("import reclaim.hugepages as h; h.enable()\n" + again)[-1])
    assert plain > 10_000 and kept < 100, (plain, kept)  # 64 MiB: 16,384 pages of 4 KiB
