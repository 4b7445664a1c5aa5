"""The `reclaim` command. Each command imports its engine lazily so `reclaim --help` stays fast."""

from __future__ import annotations

import typer

app = typer.Typer(help="reclaim: post-training engine that turns wasted compute into training.",
                  no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(help="Benchmarks: baseline and reclaim side by side; JSON + PNG under benchmarks/.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

# ---- inference: generate, chat, demo (owner: engine) ----

# ---- server: serve (owner: server) ----

# ---- ssm: ssm-train (owner: ssm) ----

# ---- benchmarks: bench engine / bench serve / bench ssm ----


if __name__ == "__main__":
    app()
