"""Device discipline the GPU path relies on, checked on any machine: a random draw with a given
generator names the device it draws on (a CUDA generator cannot fill a CPU tensor, nor a CPU one
a CUDA tensor: the crash class of `torch.rand((), generator=cuda_generator)`)."""

import ast
from pathlib import Path

import reclaim

# Factories that create a tensor from a generator: without device= they draw on the CPU.
FACTORIES = {"rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like"}


def _calls_missing_device(source: str) -> list[int]:
    """Lines of torch factory calls that pass generator= but no device=."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES:
            names = {k.arg for k in node.keywords}
            if "generator" in names and "device" not in names:
                bad.append(node.lineno)
    return bad


def test_every_generator_draw_names_its_device():
    root = Path(reclaim.__file__).parent
    bad = [f"{p.relative_to(root.parent)}:{line}" for p in sorted(root.rglob("*.py"))
           for line in _calls_missing_device(p.read_text())]
    assert not bad, f"generator= without device= (draws on the CPU whatever the generator's device): {bad}"


def test_the_check_catches_the_crash_class():
    assert _calls_missing_device("torch.rand((), generator=g, dtype=torch.float64)") == [1]
    assert _calls_missing_device("torch.rand((), generator=g, device=g.device)") == []
