"""The docs name what exists: every file docs/design.md's layout lists, every repository path and
test named in a page, every relative link. A file moved or renamed without its docs fails here,
in `make test`, before `make docs` (mkdocs --strict) would catch the links in CI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").rglob("*.md")])
# Benchmark pages still being written (issue 27): the docs link them as folders, and a link to one
# is checked once it exists.
PENDING = {"benchmarks/rl-longtail", "benchmarks/spec-history"}
# A code span naming a file of the repository, or of reclaim/ without its prefix (`engine/runner.py`).
TOP = ("reclaim/", "tests/", "scripts/", "benchmarks/", "docs/", ".ci/")
PACKAGES = ("models/", "engine/", "server/", "online/", "rl/", "drafter/", "ssm/", "data/", "bench/", "configs/")

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# 7 to 40 hex digits with a digit and a letter in them: a commit hash.
HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _prose(page: Path) -> str:
    return FENCE.sub("", page.read_text())


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def layout_paths(text: str) -> list[str]:
    """The paths of the layout block in docs/design.md: one name a line, two spaces a level, a
    folder ending in '/'."""
    block = re.search(r"^## Layout.*?^```\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/design.md has no '## Layout' section with a code block"
    stack: list[str] = []
    paths = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        stack = stack[:depth]
        paths.append("".join(stack) + name)
        if name.endswith("/"):
            stack.append(name)
    return paths


def test_design_layout_names_files_that_exist() -> None:
    paths = layout_paths((ROOT / "docs" / "design.md").read_text())
    assert len(paths) > 50, paths  # the parse found the tree, not a line of it
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/design.md's layout names paths that do not exist: {missing}"


def _named_path(span: str) -> str | None:
    """The repository path a code span names, or None when it names none."""
    span = span.split("::")[0].rstrip(".,")
    if re.search(r"[\s{}*<>$~:]", span) or "(" in span:
        return None
    if span.startswith(TOP):
        return span
    if span.startswith(PACKAGES) and "." in span.rsplit("/", 1)[-1]:
        return "reclaim/" + span
    if span.startswith("kernels/"):
        return "reclaim/models/" + span
    return None


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_paths_named_in_a_page_exist(page: Path) -> None:
    named = {p for s in SPAN.findall(_prose(page)) if (p := _named_path(s))}
    missing = sorted(p for p in named if not (ROOT / p).exists() and p.rstrip("/") not in PENDING)
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


def test_tests_named_in_the_docs_exist() -> None:
    defined = set()
    for f in (ROOT / "tests").rglob("*.py"):
        defined.update(re.findall(r"^\s*def (test_\w+)", f.read_text(), re.M))
    named = {(s, _rel(p)) for p in PAGES for s in SPAN.findall(_prose(p)) if re.fullmatch(r"test_\w+", s)}
    missing = sorted(n for n in named if n[0] not in defined)
    assert not missing, f"tests the docs name that no file under tests/ defines: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if rel in PENDING and not (path / "README.md").exists():
            continue
        if not path.exists() or (target.split("#")[0].endswith("/") and not (path / "README.md").exists()):
            broken.append(target)
    assert not broken, f"{_rel(page)} links to what does not exist: {broken}"


def test_mkdocs_nav_names_pages_that_exist() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav: list) -> list[str]:
        out = []
        for entry in nav:
            for value in entry.values():
                out += pages(value) if isinstance(value, list) else [value]
        return out
    missing = [p for p in pages(config["nav"]) if not (ROOT / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_commit_hashes_in_prose(page: Path) -> None:
    """Commits stay in the benchmark JSON (bench/meta.py), where they are exact."""
    found = HASH.findall(_prose(page))
    assert not found, f"{_rel(page)} quotes commit hashes {found}; the JSON of a result records its commit"


def test_readme_stays_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md is {lines} lines; details go to docs/ (at most 250)"
