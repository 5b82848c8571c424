"""Perturbed variants of os tasks: environment augmentation (issue 27; seed 003 §21.9.5).

A variant is a task started in a perturbed sandbox. It is declared next to its task, in the task
object's `variants` list (os_tiers.py declares them for the generated easy tier), and it is a
sample of its own: `<task id>~<variant name>`, in a split that lists every task × variant
(`easy-dev-variants`), so the dispatcher, `rollstream env check` and SFT demonstrations take it as
any other sample. Three kinds:

- `missing_tool`: a named command is removed from the sandbox before the task's init runs. The
  agent's shell, the processes it starts and the checker all get bash's own `command not found`
  (exit 127). The declaration replaces the task's `example` with one that does without the tool:
  AgentBench's checks run the example in the same sandbox to get the expected answer, and the
  golden policy runs it to answer.
- `moved_file`: the task's files live under another directory. The declaration carries the task's
  description, init and evaluation rendered for that place (os_tiers.py draws the same task again
  with another home directory), so text, golden and checker agree.
- `working_directory`: the agent's shell starts in another directory (AgentBench's starts in /);
  the task is unchanged.

How a tool goes missing: every copy on PATH (`type -aP`) is deleted from the session's root. Both
backends give each session a writable root of its own (bubblewrap: an overlay whose upper layer
lies on the session's tmpfs; Docker: the container's layer, on a tmpfs too), so the deletion
touches neither the shared root filesystem nor another session. A stub earlier on PATH that
prints "command not found" would need no deletion, but `/usr/bin/grep` would still run by its
path and an agent that resets PATH gets the tool back; a deleted tool is gone whatever the agent
does. A Docker engine that is not on this host gives a read-only root where nothing can be
deleted: there a missing_tool variant fails to start and counts as a `task_error` (the setup's
exit code is checked, unlike an init script's), which `rollstream env check` shows.

Variants are our declarations, not the policy's input, yet they are validated as if hostile: tool
names and directories are checked against narrow patterns and quoted, tools the sandbox and the
checkers need (`RESERVED_TOOLS`) and bash builtins (deleting a file cannot remove them) are
refused. The setup runs like an init script: inside the sandbox, as its root, under its limits.
A variant adds nothing the agent could not do itself in its own sandbox.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MISSING_TOOL = "missing_tool"
MOVED_FILE = "moved_file"
WORKING_DIRECTORY = "working_directory"
KINDS = (MISSING_TOOL, MOVED_FILE, WORKING_DIRECTORY)

SEPARATOR = "~"  # `<task id>~<variant name>`: no task id of the os family holds it
# What a variant may replace of its task object (AgentBench's task fields; never the image or `start`).
TASK_FIELDS = ("description", "create", "evaluation")
# Needed by the sandbox itself or by AgentBench's checks: the shell and every script run in bash (system
# scripts in sh, i.e. dash), the shell session decodes each command with base64, scripts enter through
# /usr/bin/env, the integer- and string-match checks are python3, the edit checks read files with cat.
RESERVED_TOOLS = frozenset({"bash", "sh", "dash", "env", "base64", "python3", "cat"})
# `compgen -b` of bash 5.2: removing a file of that name leaves the builtin in place.
BASH_BUILTINS = frozenset(
    ". : [ alias bg bind break builtin caller cd command compgen complete compopt continue declare dirs disown "
    "echo enable eval exec exit export false fc fg getopts hash help history jobs kill let local logout mapfile "
    "popd printf pushd pwd read readarray readonly return set shift shopt source suspend test times trap true "
    "type typeset ulimit umask unalias unset wait".split()
)
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
TOOL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,63}")
DIRECTORY_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


class VariantError(ValueError):
    """A variant declaration that cannot be applied safely (unknown kind, reserved tool, odd path)."""


@dataclass(frozen=True)
class Variant:
    """One perturbed start of a task; `task` holds the task fields the variant replaces."""

    name: str
    kind: str
    tool: str | None = None
    cwd: str | None = None
    task: Mapping[str, Any] = field(default_factory=dict)


def missing_tool(tool: str, task: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """The declaration of a missing-tool variant; `task` replaces the fields whose example used the tool."""
    return {"name": name or f"no-{tool}", "kind": MISSING_TOOL, "tool": tool, "task": dict(task)}


def moved_file(task: Mapping[str, Any], name: str = "moved") -> dict[str, Any]:
    """The declaration of a moved-file variant; `task` is the task rendered with its files elsewhere."""
    return {"name": name, "kind": MOVED_FILE, "task": dict(task)}


def working_directory(cwd: str, name: str = "cwd") -> dict[str, Any]:
    """The declaration of a variant whose shell starts in `cwd`."""
    return {"name": name, "kind": WORKING_DIRECTORY, "cwd": cwd}


def _directory(path: Any) -> str:
    parts = path.split("/")[1:] if isinstance(path, str) and path.startswith("/") else None
    if not parts or not all(DIRECTORY_PART.fullmatch(part) and part.strip(".") for part in parts):
        raise VariantError(f"a directory must be an absolute path of plain names, got {path!r}")
    return path


def parse_variant(raw: Mapping[str, Any], rendered: bool = False) -> Variant:
    """A declaration checked: the name, the kind and the one parameter its kind needs. `rendered`: the
    declaration as a sample carries it, its task fields already applied (a moved file then needs none)."""
    name, kind = raw.get("name"), raw.get("kind")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise VariantError(f"a variant name is lowercase letters, digits and '-', got {name!r}")
    if kind not in KINDS:
        raise VariantError(f"variant {name}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    task = raw.get("task") or {}
    if not isinstance(task, Mapping) or set(task) - set(TASK_FIELDS):
        raise VariantError(f"variant {name}: a variant may replace only {', '.join(TASK_FIELDS)}")
    if kind == MISSING_TOOL:
        tool = raw.get("tool")
        if not isinstance(tool, str) or not TOOL.fullmatch(tool):
            raise VariantError(f"variant {name}: a missing tool is a plain command name, got {tool!r}")
        if tool in RESERVED_TOOLS or tool in BASH_BUILTINS:
            raise VariantError(f"variant {name}: {tool!r} cannot go missing (the sandbox needs it, or bash has it built in)")
        return Variant(name, kind, tool=tool, task=task)
    if kind == MOVED_FILE:
        if not task and not rendered:
            raise VariantError(f"variant {name}: a moved-file variant carries its task rendered elsewhere")
        return Variant(name, kind, task=task)
    return Variant(name, kind, cwd=_directory(raw.get("cwd")), task=task)


def variants_of(item: Mapping[str, Any]) -> list[Variant]:
    """The variants a task object declares, in order; names are unique within a task."""
    variants = [parse_variant(raw) for raw in item.get("variants") or ()]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise VariantError(f"variant names repeat: {names}")
    return variants


def variant_item(item: Mapping[str, Any], variant: Variant) -> dict[str, Any]:
    """The task object as the variant starts it: the base task with the variant's fields in place."""
    base = {key: value for key, value in item.items() if key != "variants"}
    return {**base, **variant.task}


def variant_id(task_id: str, variant: Variant) -> str:
    return f"{task_id}{SEPARATOR}{variant.name}"


def session_fields(variant: Variant) -> dict[str, Any]:
    """What a sample carries of its variant (sample["variant"]): what the session must do at start,
    and the name and kind that reports group by."""
    return {"name": variant.name, "kind": variant.kind, "tool": variant.tool, "cwd": variant.cwd}


def from_sample(sample: Mapping[str, Any]) -> Variant | None:
    """The sample's variant, validated again (a sample may come from anywhere), or None for a plain task."""
    raw = sample.get("variant")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise VariantError(f"a sample's variant is an object, got {raw!r}")
    return parse_variant({key: value for key, value in raw.items() if value is not None}, rendered=True)


def setup_script(variant: Variant) -> str | None:
    """Bash run as the sandbox's root before the task's init; it must exit 0 or the session cannot start."""
    if variant.kind == MISSING_TOOL:
        tool = shlex.quote(str(variant.tool))
        # `type -aP` lists every file of that name on PATH (with merged /usr, /bin/x and /usr/bin/x are one
        # file); the last line proves that neither a file nor anything else answers to the name any more.
        return (f"for path in $(type -aP -- {tool}); do rm -f -- \"$path\" || exit 1; done; "
                f"! type -- {tool} >/dev/null 2>&1")
    if variant.kind == WORKING_DIRECTORY:
        return f"mkdir -p -- {shlex.quote(str(variant.cwd))}"
    return None


def shell_command(variant: Variant) -> str | None:
    """Run in the agent's shell after the setup, before the task's init: where the shell starts."""
    if variant.kind == WORKING_DIRECTORY:
        return f"cd -- {shlex.quote(str(variant.cwd))}"
    return None
