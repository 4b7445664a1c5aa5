"""Build and load the C kernels beside this file, once per source, compiler and CPU.

A kernel is compiled with the system C compiler on first use, for this CPU (`-march=native`),
into `cache_root()/kernels/` (once across processes; a later process loads it). Without a
compiler, on another OS, or with `RECLAIM_SMALL_LINEAR=0` (the switch that turns reclaim's CPU
kernels off), `load` returns None and `why_not` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from reclaim.paths import cache_root
from reclaim.storage import build_once

_libs: dict[str, ctypes.CDLL | None] = {}
_why: dict[str, str] = {}


def _cpu_key(source: Path) -> str:
    """What the compiled code depends on: the source and the headers beside it, the compiler and
    this CPU's features."""
    h = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.read_bytes())
    h.update(platform.machine().encode())
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        h.update(flags[0].encode() if flags else b"")
    except OSError:
        pass
    h.update(subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.encode())
    return h.hexdigest()[:16]


def _compile(source: Path, out_dir: Path) -> None:
    cmd = ["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o",
           str(out_dir / f"{source.stem}.so"), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")


def load(name: str) -> ctypes.CDLL | None:
    """The kernel compiled from `<name>.c` beside this file, building it on first use; None
    where it cannot be had (then `why_not(name)` says why)."""
    if name in _libs:
        return _libs[name]
    source = Path(__file__).with_name(f"{name}.c")
    lib = None
    if os.environ.get("RECLAIM_SMALL_LINEAR", "1") == "0":
        _why[name] = "switched off by RECLAIM_SMALL_LINEAR=0"
    elif sys.platform != "linux" or shutil.which("cc") is None:
        _why[name] = f"needs Linux and a C compiler ('cc'); platform {sys.platform!r}, cc {shutil.which('cc')!r}"
    else:
        try:
            target = build_once(cache_root() / "kernels" / f"{name}-{_cpu_key(source)}",
                                lambda out: _compile(source, out))
            # torch has loaded its libgomp.so.1, so the kernel shares torch's OpenMP threads.
            lib = ctypes.CDLL(str(target / f"{name}.so"))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why[name] = f"could not build the kernel: {e}"
            warnings.warn(f"reclaim: C kernel {name} unavailable, using torch ({_why[name]})", stacklevel=3)
    _libs[name] = lib
    return lib


def why_not(name: str) -> str | None:
    """Why `load(name)` gave None (None when it loaded or was not tried)."""
    return _why.get(name)
