"""Transparent huge pages for the memory tensors on a CPU come from (glibc's malloc).

A tensor's memory comes from malloc; fresh memory costs a page fault per 4 KiB on first touch
(1 GiB: 0.4-1.0 s of faults on this project's CPU VMs against 0.04 s to write it again). Serving
allocates fresh memory all the time: every prefill's activations, and with `serve --learn` every
recorded prompt, kept until it is trained on (a 132-token record of SmolLM2 is ~160 MB, 42k faults:
its prefill took 0.46 s against 0.37 s unrecorded; 0.38 s with huge pages). glibc's tunable
`glibc.malloc.hugetlb=1` (glibc >= 2.35) makes malloc ask for transparent huge pages, 2 MiB a
fault: in `reclaim bench online`'s stream, 270k faults a pass of plain serving became 9.6k, and
845k in the serving thread of a pass with recording and training 7k.

glibc reads tunables only when a process starts, so `enable()` (called first thing by the `reclaim`
command) re-executes the same command line once with the tunable added to GLIBC_TUNABLES; the
process keeps its pid. RECLAIM_HUGEPAGES=0 turns it off; elsewhere than Linux with glibc it does
nothing.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether this process should re-execute itself with huge pages for malloc."""
    env = os.environ if environ is None else environ
    if env.get("RECLAIM_HUGEPAGES", "1") == "0" or "glibc.malloc.hugetlb" in env.get("GLIBC_TUNABLES", ""):
        return False
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def enable() -> None:
    """Re-execute this command with glibc.malloc.hugetlb=1 unless it has it (or it is off or
    not glibc). Call before anything has run: the new process starts over."""
    if not wanted():
        return
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES", ""), TUNABLE) if t)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "GLIBC_TUNABLES": tunables})
