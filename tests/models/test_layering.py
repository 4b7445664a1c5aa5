"""The model core stands alone: nothing under reclaim/models imports an engine, the server or a CLI."""

import ast
from pathlib import Path

import reclaim.models

MODELS = Path(reclaim.models.__file__).parent
ABOVE = ("reclaim.ssm", "reclaim.engine", "reclaim.server", "reclaim.online", "reclaim.rl",
         "reclaim.bench", "reclaim.cli", "reclaim.data")


def imported_modules(path: Path) -> list[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                pkg = ".".join(("reclaim",) + path.relative_to(MODELS.parent).parent.parts)
                pkg = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                names.append(f"{pkg}.{node.module}" if node.module else pkg)
            else:
                names.append(node.module)
    return names


def test_models_import_nothing_from_engines_or_server():
    files = sorted(MODELS.rglob("*.py"))
    assert any(f.name == "mamba.py" for f in files) and any(f.parent.name == "kernels" for f in files)
    bad = {f"{f.relative_to(MODELS.parent)}: {m}" for f in files for m in imported_modules(f)
           if any(m == a or m.startswith(a + ".") for a in ABOVE)}
    assert not bad, f"reclaim.models must not import from {ABOVE}: {sorted(bad)}"
