"""glibc's malloc, which tensors on a CPU come from, set up for a process that keeps allocating
and freeing activations: transparent huge pages, and freed memory kept for reuse.

Fresh memory costs a page fault per 4 KiB on first touch, and on this project's CPU VMs far more
when the memory was handed back to the kernel (1 GiB: 0.4 s of faults against 0.04 s to write it
again; 1.7-2.3 s the first time with huge pages, 0.11 s after). Serving allocates all the time:
every prefill's activations, and with `serve --learn` every recorded prompt, kept until trained on
(a 132-token SmolLM2 record is ~170 MB: its prefill took 0.37 s unrecorded, 0.46 s recorded, and
0.78-0.86 s once the process had grown past the memory it had touched before). So:

- glibc.malloc.hugetlb=1: malloc asks for transparent huge pages, 2 MiB a fault (a pass of
  `bench online`'s serving stream: 270k faults serving alone became 9.6k);
- glibc.malloc.mmap_threshold=32 MiB and trim_threshold=32 GiB: blocks up to 32 MiB come from
  malloc's heap and freed ones stay there for the next allocation instead of going back to the
  kernel (the process keeps its peak memory; a recorded prefill then cost 0.93-1.06x the
  unrecorded prefill of its length in most steps of that stream, against ~2x with memory returned).

glibc reads tunables only when a process starts, so `enable()` (called first thing by the `reclaim`
command) re-executes the same command line once with the missing ones added to GLIBC_TUNABLES; the
process keeps its pid. A tunable already named in GLIBC_TUNABLES is left as it is;
RECLAIM_HUGEPAGES=0 turns it all off; elsewhere than Linux with glibc it does nothing.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = ("glibc.malloc.hugetlb=1", f"glibc.malloc.mmap_threshold={32 << 20}",
            f"glibc.malloc.trim_threshold={32 << 30}")


def missing(environ: dict[str, str] | None = None) -> list[str]:
    """The tunables this process should re-execute itself with (none: leave it as it is)."""
    env = os.environ if environ is None else environ
    if env.get("RECLAIM_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux") \
            or platform.libc_ver()[0] != "glibc":
        return []
    have = env.get("GLIBC_TUNABLES", "")
    return [t for t in TUNABLES if t.split("=")[0] + "=" not in have]


def enable() -> None:
    """Re-execute this command with the missing tunables (see `missing`). Call before anything
    has run: the new process starts over."""
    add = missing()
    if not add:
        return
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES", ""), *add) if t)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "GLIBC_TUNABLES": tunables})
