"""mkdocs hook: the site is the repository's own tree, so a link reads the same on GitHub and on
the site, and `mkdocs build --strict` checks every one of them.

mkdocs refuses the repository root as docs_dir, so docs_dir is docs/; but the pages link to
../README.md, ../benchmarks/<name>/README.md and source files. Here each file of docs/ is given its
repository path (docs/serving.md), and README.md, the benchmark pages (with their plots and JSON)
and the source under reclaim/ and scripts/ are added at theirs. With use_directory_urls off the
site's paths are the repository's (README.md becomes index.html)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# Repository paths besides docs/ that the site carries, and the kinds of file taken from each.
EXTRA = {"README.md": None, "benchmarks": (".md", ".png", ".json"), "reclaim": (".py", ".c", ".yaml"),
         "scripts": (".py",)}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).parent
    docs = Path(config.docs_dir)
    prefix = docs.relative_to(root).as_posix()
    site, urls = config.site_dir, config.use_directory_urls
    out = []
    for f in files:
        if f.src_dir is not None and Path(f.src_dir) == docs:  # a page or asset of docs/
            out.append(File(f"{prefix}/{f.src_uri}", str(root), site, urls, inclusion=f.inclusion))
        else:  # the theme's own assets
            out.append(f)
    for name, kinds in EXTRA.items():
        path = root / name
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in kinds)
        for p in found:
            if "__pycache__" not in p.parts:
                out.append(File(p.relative_to(root).as_posix(), str(root), site, urls))
    return Files(out)
