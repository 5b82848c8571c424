"""What every `rollstream` command shares: its option definitions, and one way to fail.

Exit codes: 0 done, BAD_INPUT (2) for a usage or input mistake (options, files, the configuration, or
services the configuration names that cannot be reached), CHECK_FAILED (1) for a check or run that
failed, INTERRUPTED (130) after Ctrl-C. A failure is one line on stderr, `rollstream <command>: what
is wrong`, never a traceback: `fail` prints it, and every command built by `App` (a `Command`)
turns the errors that library code raises for a bad configuration or an unreachable service into
the same line, so no command handles them itself.
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from confluent_kafka import KafkaException
from typer._click import Context
from typer._click.globals import get_current_context  # typer carries its own click: its context stack
from typer.core import TyperCommand

from pipeline.run.config import ConfigError
from pipeline.run.infra import Unreachable

CHECK_FAILED = 1
BAD_INPUT = 2
INTERRUPTED = 130
ROOT = "rollstream"

ConfigOption = Annotated[Path | None, typer.Option(
    "--config", help="YAML run configuration (configs/); ROLLSTREAM_ environment variables override it.")]
JsonOption = Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")]
RunOption = Annotated[str, typer.Option("--run", help="Run id: stamped on every event of the run.")]
QuietOption = Annotated[bool, typer.Option("--quiet", help="No progress on stderr.")]
SettingsOption = Annotated[Path | None, typer.Option(
    "--settings", help="The component's settings as JSON (what `rollstream up` passes); replaces the "
                       "individual settings options.")]
ModelOption = Annotated[Path, typer.Option("--model", help="Hugging Face checkpoint directory of the policy.")]


def command_name(ctx: Context | None) -> str:
    """`rollstream env check` for the command of `ctx`, also when a test invokes a sub-app on its own."""
    chain: list[Context] = []
    while ctx is not None:
        chain.append(ctx)
        ctx = ctx.parent
    if not chain:
        return ROOT
    chain.reverse()
    parts = [c.info_name or "" for c in chain[1:]]
    root = chain[0].command.name
    if root and root != ROOT:  # a sub-app invoked by itself: its own name stands for the root's
        parts.insert(0, root)
    return " ".join([ROOT, *parts])


def fail(message: str, code: int = BAD_INPUT) -> NoReturn:
    """Ends the command: `rollstream <command>: message` on stderr and exit `code`."""
    typer.echo(f"{command_name(get_current_context(silent=True))}: {message}", err=True)
    raise typer.Exit(code=code)


def read_json_lists(path: Path, required: tuple[str, ...], known: tuple[str, ...] | None = None) -> dict[str, Any]:
    """One JSON object from `path` holding a list under each `required` key (and, when `known` is given, no
    key outside it); any other input ends the command in one line (`fail`)."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        fail(f"{path} is not JSON: {e}")
    if not isinstance(data, dict):
        fail(f"{path} must hold one JSON object with {', '.join(required)}")
    if known is not None:
        unknown = sorted(set(data) - set(known))
        if unknown:
            fail(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    missing = [f for f in required if not isinstance(data.get(f), list)]
    if missing:
        fail(f"{path} lacks the list(s) {', '.join(missing)}")
    return data


class Command(TyperCommand):
    """A command that reports a bad configuration or an unreachable service in one line (BAD_INPUT)."""

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ConfigError, Unreachable) as error:
            message = str(error)
        except KafkaException as error:  # the broker refused or could not be reached
            reason = error.args[0] if error.args else error
            message = f"Kafka: {reason.str() if hasattr(reason, 'str') else reason}"
        typer.echo(f"{command_name(ctx)}: {message}", err=True)
        raise typer.Exit(code=BAD_INPUT)


class App(typer.Typer):
    """A Typer app whose commands are `Command`s; tracebacks are never shown (one line instead)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("add_completion", False)
        kwargs.setdefault("pretty_exceptions_enable", False)
        super().__init__(**kwargs)

    def command(self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **kwargs: Any) -> Any:
        return super().command(name, cls=cls or Command, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Typer's own __call__ marks an escaping exception for its pretty printer with setattr, which
        # fails on frozen exceptions (minio's S3Error): the process then died saying "S3Error is frozen"
        # instead of what the store answered. Pretty printing is off here, so the mark is not needed.
        return typer.main.get_command(self)(*args, **kwargs)
