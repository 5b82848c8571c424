"""The `rollstream` command line: argument parsing only, the work is done by the library subpackages.

Every subcommand lives in its own module and is registered in pipeline/cli/commands.py. Conventions
(STYLE.md): machine-readable output with `--json` on stdout, progress and logs on stderr, a user mistake
ends in one line and a non-zero exit (pipeline/cli/toolkit.py: the options every command shares,
`fail`, the exit codes), and each command's help shows an example. No library module imports this
package: only the CLI itself, and tests that drive it.

This package imports nothing itself: `app` and `main` load the whole command line on first use, so that
a run's processes, each started as its own module (`python -m pipeline.cli.dispatch`...), import only what
their command needs. Loading every subcommand brings torch, transformers and vLLM's imports with it:
seconds of CPU for each of a run's children, and the run's engines compete for those cores.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from pipeline.cli import commands  # noqa: PLC0415

        return getattr(commands, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
