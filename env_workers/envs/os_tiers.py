"""os easy tier: generated short shell tasks in AgentBench's OS task format, for a policy too small for its data.

Splits `easy-train` and `easy-dev`, drawn from `EnvSettings.os_tier_seed` and the split and index
alone (the same task in every process). Six kinds, each solved by one short command: count files
of an extension, count matching lines, find the file holding a word, read a value from a config
file, change that value, create a file with a given line. Directories hold 2 to 6 small files, so
every output is a line or two.

Each task is a raw AgentBench task object (description, create.init, evaluation) parsed by
os_tasks.parse_task as the shipped tasks are, and checked AgentBench's way: questions by
`[null, check/integer-match.py | check/string-match.py]` (the reference `example` runs in the
sandbox and the answer must equal its output), edits by a bash check of the file's contents. So
the golden policy runs the example and answers its output, and the no-op (finish, answer "None")
fails every task: no answer is "None", and no init leaves a file as an edit wants it.
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Sequence
from typing import Any

from env_workers.envs.base import EnvSettings
from env_workers.envs.os_tasks import parse_task

SCRIPTS = "agentbench/os_interaction/scripts/7"  # its check/ holds AgentBench's integer- and string-match
INTEGER_MATCH = {"language": "python", "file": "check/integer-match.py"}
STRING_MATCH = {"language": "python", "file": "check/string-match.py"}

DIRS = ("data", "logs", "docs", "work", "notes", "files")
STEMS = ("a", "b", "c", "d", "e", "f", "g", "h", "x", "y", "z", "log", "tmp", "old", "new", "main")
EXTENSIONS = ("txt", "log", "csv", "md", "py")
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket", "garden", "silver")
KEYS = ("port", "host", "user", "mode", "level", "color", "size", "name")
VALUES = ("8080", "9000", "alpha", "beta", "debug", "info", "blue", "green", "small", "large", "42", "7")
KINDS = ("count_files", "count_lines", "find_file", "read_value", "edit_value", "create_file")
SPLITS = ("easy-train", "easy-dev")


def _write(path: str, lines: Sequence[str]) -> str:
    return f"printf '%s\\n' {' '.join(shlex.quote(line) for line in lines)} > {path}"


def _question(description: str, init: Sequence[str], example: str, check: dict[str, str]) -> dict[str, Any]:
    return {"description": description, "create": {"local": "default", "init": {"code": " && ".join(init)}},
            "evaluation": {"check": [None, check], "example": {"code": example}}, "labels": ["generated"]}


def _edit(description: str, init: Sequence[str], example: str, check: str) -> dict[str, Any]:
    return {"description": description, "create": {"local": "default", "init": {"code": " && ".join(init)}},
            "evaluation": {"check": {"code": check}, "example": {"code": example}}, "labels": ["generated"]}


def _files(rng: random.Random, folder: str, count: int) -> list[str]:
    return [f"{folder}/{stem}.{rng.choice(EXTENSIONS)}" for stem in rng.sample(STEMS, count)]


def count_files(rng: random.Random) -> dict[str, Any]:
    folder, ext = f"/root/{rng.choice(DIRS)}", rng.choice(EXTENSIONS)
    files = _files(rng, folder, rng.randint(2, 6))
    files[0] = files[0].rsplit(".", 1)[0] + f".{ext}"  # at least one: the answer is never 0
    init = [f"mkdir -p {folder}", "touch " + " ".join(files)]
    return _question(f"How many files with the extension .{ext} are in {folder}? Answer with a number.", init,
                     f"ls {folder}/*.{ext} | wc -l", INTEGER_MATCH)


def count_lines(rng: random.Random) -> dict[str, Any]:
    path, word = f"/root/{rng.choice(STEMS)}.txt", rng.choice(WORDS)
    lines = [" ".join(rng.sample(WORDS, 2)) for _ in range(rng.randint(2, 6))]
    if not any(word in line.split() for line in lines):
        lines[rng.randrange(len(lines))] += f" {word}"
    return _question(f"How many lines of {path} contain the word {word}? Answer with a number.",
                     [_write(path, lines)], f"grep -cw {word} {path}", INTEGER_MATCH)


def find_file(rng: random.Random) -> dict[str, Any]:
    folder = f"/root/{rng.choice(DIRS)}"
    names = [f"{stem}.txt" for stem in rng.sample(STEMS, rng.randint(2, 5))]
    word, *others = rng.sample(WORDS, 4)
    target = rng.choice(names)
    init = [f"mkdir -p {folder}"] + [_write(f"{folder}/{n}", [word if n == target else rng.choice(others)])
                                      for n in names]
    return _question(f"Which file in {folder} contains the word {word}? Answer with the file name only.", init,
                     f"cd {folder} && grep -lw {word} *", STRING_MATCH)


def _config(rng: random.Random) -> tuple[str, list[str], int, str, str]:
    path = f"/root/{rng.choice(('app', 'site', 'db', 'game'))}.conf"
    keys = rng.sample(KEYS, rng.randint(2, 4))
    values = [rng.choice(VALUES) for _ in keys]
    at = rng.randrange(len(keys))
    return path, [f"{k}={v}" for k, v in zip(keys, values)], at, keys[at], values[at]


def read_value(rng: random.Random) -> dict[str, Any]:
    path, lines, _, key, _ = _config(rng)
    return _question(f"What is the value of {key} in {path}? Answer with the value only.", [_write(path, lines)],
                     f"grep '^{key}=' {path} | cut -d= -f2", STRING_MATCH)


def edit_value(rng: random.Random) -> dict[str, Any]:
    path, lines, at, key, old = _config(rng)
    new = rng.choice([v for v in VALUES if v != old])
    wanted = [*lines[:at], f"{key}={new}", *lines[at + 1:]]
    expected = "\n".join(wanted)
    return _edit(f"In {path}, change the value of {key} to {new}; leave the other lines as they are.",
                 [_write(path, lines)], f"sed -i 's/^{key}=.*/{key}={new}/' {path}",
                 f"[ \"$(cat {path})\" = {shlex.quote(expected)} ]")


def create_file(rng: random.Random) -> dict[str, Any]:
    folder, name, word = f"/root/{rng.choice(DIRS)}", f"{rng.choice(STEMS)}.txt", rng.choice(WORDS)
    path = f"{folder}/{name}"
    return _edit(f"Create the file {path} holding the single line {word}.", [f"mkdir -p {folder}"],
                 f"echo {word} > {path}", f"[ \"$(cat {path})\" = {word} ]")


BUILDERS = {"count_files": count_files, "count_lines": count_lines, "find_file": find_file,
            "read_value": read_value, "edit_value": edit_value, "create_file": create_file}


def make_item(split: str, index: int, seed: int) -> dict[str, Any]:
    """The raw AgentBench task object at (seed, split, index); the six kinds take turns."""
    rng = random.Random(f"os-tier/{seed}/{split}/{index}")
    return BUILDERS[KINDS[index % len(KINDS)]](rng)


def generate(split: str, settings: EnvSettings) -> list[dict[str, Any]]:
    """A split's tasks as os samples; easy-dev skips any task that easy-train has word for word."""
    scripts_dir = settings.data_root / SCRIPTS
    seed = settings.os_tier_seed

    def sample(item: dict[str, Any], index: int) -> dict[str, Any]:
        return parse_task(item, scripts_dir, f"{split}-{index:05d}")

    train = [make_item("easy-train", i, seed) for i in range(settings.os_tier_train_tasks)]
    if split == "easy-train":
        return [sample(item, i) for i, item in enumerate(train)]
    seen = {repr(item) for item in train}
    tasks: list[dict[str, Any]] = []
    index = 0
    while len(tasks) < settings.os_tier_dev_tasks:
        item = make_item(split, index, seed)
        if repr(item) not in seen:
            tasks.append(sample(item, len(tasks)))
        index += 1
    return tasks
