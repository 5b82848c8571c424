"""AgentBench OS interaction tasks as plain data: loading, script resolution and grading.

Mirrors THUDM/AgentBench src/server/tasks/os_interaction/task.py (`_load_configs`, `_judge`):
- a task file holds one task or a list; a script is a string (bash), `{"code"}` or `{"file"}`
  (relative to `scripts/N/` beside `data/N/`; the training set uses `scripts/7/`), with an
  optional `language` (bash, python, c, c++);
- `match`: a plain string is compared after stripping the answer; `{"answer"}` exactly;
  `{"regex"}` by search;
- `check`: scripts run in order with the answer (`str(answer)`, so a bare finish gives "None"),
  then each earlier script's output, as arguments; `null` runs the `example`; all must exit 0.
Quirks of the shipped data (`../shared/data/README.md`): a `create` that is a list counts as no
`create`; an `example` at the top level counts as the evaluation's example.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# A script as the samples carry it: [language, code].
Script = list[str]
# Runs one script with its arguments in the task's sandbox: (exit code, combined output).
Runner = Callable[[Script, Sequence[str]], Awaitable[tuple[int, str]]]


class TaskFormatError(ValueError):
    """A task whose definition cannot be read (a missing script file, an unknown script form)."""


def scripts_dir_for(task_file: Path) -> Path:
    """AgentBench's pairing: `.../data/N/x.json` -> `.../scripts/N/`; `train_0317/*` -> `scripts/7/`."""
    task_file = task_file.resolve()
    if task_file.parent.parent.name == "data":
        return task_file.parent.parent.parent / "scripts" / task_file.parent.name
    return task_file.parent.parent / "scripts" / "7"


def load_script(raw: Any, scripts_dir: Path) -> Script | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return ["bash", raw]
    if not isinstance(raw, Mapping):
        raise TaskFormatError(f"invalid script object {raw!r}")
    language = raw.get("language", "bash")
    if "file" in raw:
        path = scripts_dir / raw["file"]
        try:
            return [language, path.read_text(encoding="utf-8")]
        except OSError as error:
            raise TaskFormatError(f"script file {path} cannot be read: {error}") from error
    if "code" in raw:
        return [language, raw["code"]]
    raise TaskFormatError(f"invalid script object {raw!r}")


def _scripts(raw: Any, scripts_dir: Path) -> list[Script | None]:
    items = raw if isinstance(raw, list) else [raw]
    return [load_script(item, scripts_dir) for item in items]


def task_id(task_file: Path, index: int) -> str:
    """`data/1/stock-00003` or `train_0317/training-00003`: AgentBench's file stem + index, with its folder."""
    task_file = task_file.resolve()
    folder = f"data/{task_file.parent.name}" if task_file.parent.parent.name == "data" else task_file.parent.name
    return f"{folder}/{task_file.stem}-{index:05d}"


def parse_task(item: Mapping[str, Any], scripts_dir: Path, sample_id: str) -> dict[str, Any]:
    """One task as a plain dict sample with every script resolved to [language, code]."""
    create = item.get("create")
    create = create if isinstance(create, Mapping) else {}
    evaluation = item["evaluation"]
    match = evaluation.get("match")
    if isinstance(match, str):
        match = {"answer": match, "strip": True}
    check = _scripts(evaluation["check"], scripts_dir) if "check" in evaluation else None
    if match is None and check is None:
        raise TaskFormatError(f"task {sample_id}: check or match must exist")
    example = evaluation.get("example", item.get("example"))
    return {
        "id": sample_id,
        "description": item["description"],
        "image": create.get("local", "default"),
        "init": _scripts(create["init"], scripts_dir) if "init" in create else [],
        "start": load_script(item.get("start"), scripts_dir),
        "match": dict(match) if match is not None else None,
        "check": check,
        "example": load_script(example, scripts_dir),
        "labels": list(item.get("labels", [])),
    }


def load_tasks(task_file: Path, scripts_dir: Path | None = None) -> list[dict[str, Any]]:
    """Every task of a `.json` (one task or a list) or `.jsonl` file, scripts resolved."""
    text = task_file.read_text(encoding="utf-8")
    if task_file.suffix == ".jsonl":
        raw = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        raw = json.loads(text)
        raw = raw if isinstance(raw, list) else [raw]
    scripts_dir = scripts_dir or scripts_dir_for(task_file)
    return [parse_task(item, scripts_dir, task_id(task_file, index)) for index, item in enumerate(raw)]


def script_argv(script: Script, params: Sequence[str]) -> list[list[str]]:
    """The processes that run a script, in order (AgentBench's execute_independent); the last one counts."""
    language, code = script
    if language == "bash":
        return [["bash", "-c", code, *(["--", *params] if params else [])]]
    if language == "python":
        return [["python3", "-c", code, *params]]
    if language in ("c", "c++"):
        compiler = "gcc" if language == "c" else "g++"
        build = f'echo "{json.dumps(code)}" > /tmp/main.cpp && {compiler} -o /tmp/a.out /tmp/main.cpp'
        return [["bash", "-c", build], ["/tmp/a.out", *params]]
    raise TaskFormatError(f"unsupported script language {language!r}")


def match_answer(match: Mapping[str, Any], answer: str | None) -> bool:
    if isinstance(answer, str) and match.get("strip"):
        answer = answer.strip()
    if answer is None:
        return False
    if "answer" in match:
        return answer == match["answer"]
    if "regex" in match:
        return re.search(match["regex"], answer) is not None
    return False


async def grade(task: Mapping[str, Any], answer: str | None, run: Runner) -> bool:
    """AgentBench's judgement of a final answer (None: the agent finished without answering)."""
    if task["match"] is not None:
        return match_answer(task["match"], answer)
    params = [str(answer)]
    for script in task["check"]:
        if script is None:
            script = task["example"]
            if script is None:
                raise TaskFormatError(f"task {task['id']}: a null check needs an example")
        code, output = await run(script, params)
        if code != 0:
            return False
        params.append(output)
    return True
