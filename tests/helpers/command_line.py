"""Parsing a `rollstream` command line with the real command tree, without running it: deployment files
(deploy/k8s, docker-compose.yml) and `rollstream process` are checked against the options that exist."""

from __future__ import annotations

import typer

from pipeline import cli


def parse_rollstream(args: list[str]) -> tuple[str, dict]:
    """(subcommand path, params) of `args` parsed by the real rollstream command tree; a bad option raises."""
    command = typer.main.get_command(cli.app)
    ctx = command.make_context("rollstream", [], resilient_parsing=True)  # the group's context only
    path = []
    while hasattr(command, "get_command"):  # a group (typer carries its own click: no isinstance check)
        assert args, f"`rollstream {' '.join(path)}` needs a subcommand"
        name, args = args[0], args[1:]
        command = command.get_command(ctx, name)
        assert command is not None, f"no subcommand {name!r} under `rollstream {' '.join(path)}`"
        path.append(name)
        ctx = command.context_class(command, info_name=name, parent=ctx)
    params = command.make_context(path[-1], list(args), parent=ctx.parent, resilient_parsing=False).params
    return " ".join(path), params
