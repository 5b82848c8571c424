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

Every task declares its perturbed variants (`os_variants.py`) in its `variants` list: the tool its
example relies on gone, with an example that does without it (not for create_file, whose `echo`
is a bash builtin); its files under another home directory (the same draws rendered there, so the
text, the example and the check move together); the agent's shell started in another directory.
Splits `easy-train-variants` and `easy-dev-variants` list every task of `easy-train` / `easy-dev`
× each of its variants, with ids `<task id>~<variant name>` (`easy-dev-00003~no-grep`). Variant
parameters come from their own generator (`.../variants`), so declaring them changed no draw of
the tasks themselves.
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Sequence
from typing import Any, NamedTuple

from env_workers.envs import os_variants
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
VARIANTS_SUFFIX = "-variants"
VARIANT_SPLITS = tuple(split + VARIANTS_SUFFIX for split in SPLITS)

HOME = "/root"  # where every task's files live
# Where a moved_file variant puts them, and where a working_directory variant starts the shell: places
# that exist or can be made in both backends (also under Docker's read-only fallback, whose tmpfs
# mounts include /tmp, /var/tmp, /home, /opt, /srv and /mnt).
MOVED_HOMES = ("/srv/share", "/opt/app", "/home/user", "/mnt/files")
START_DIRECTORIES = ("/tmp", "/var/tmp", "/home", "/opt", "/srv", "/mnt")


class Built(NamedTuple):
    """A generated task object, and for each tool its example uses, an example that does without it."""

    item: dict[str, Any]
    without: dict[str, str]


def _write(path: str, lines: Sequence[str]) -> str:
    return f"printf '%s\\n' {' '.join(shlex.quote(line) for line in lines)} > {path}"


def _question(description: str, init: Sequence[str], example: str, check: dict[str, str]) -> dict[str, Any]:
    return {"description": description, "create": {"local": "default", "init": {"code": " && ".join(init)}},
            "evaluation": {"check": [None, check], "example": {"code": example}}, "labels": ["generated"]}


def _edit(description: str, init: Sequence[str], example: str, check: str) -> dict[str, Any]:
    return {"description": description, "create": {"local": "default", "init": {"code": " && ".join(init)}},
            "evaluation": {"check": {"code": check}, "example": {"code": example}}, "labels": ["generated"]}


def _home(home: str) -> list[str]:
    """Init that makes a moved home; none for /root, so the tasks in place keep the init they always had."""
    return [] if home == HOME else [f"mkdir -p {home}"]


def _files(rng: random.Random, folder: str, count: int) -> list[str]:
    return [f"{folder}/{stem}.{rng.choice(EXTENSIONS)}" for stem in rng.sample(STEMS, count)]


def count_files(rng: random.Random, home: str = HOME) -> Built:
    folder, ext = f"{home}/{rng.choice(DIRS)}", rng.choice(EXTENSIONS)
    files = _files(rng, folder, rng.randint(2, 6))
    files[0] = files[0].rsplit(".", 1)[0] + f".{ext}"  # at least one: the answer is never 0
    init = [f"mkdir -p {folder}", "touch " + " ".join(files)]
    return Built(_question(f"How many files with the extension .{ext} are in {folder}? Answer with a number.", init,
                           f"ls {folder}/*.{ext} | wc -l", INTEGER_MATCH),
                 {"ls": f"find {folder} -maxdepth 1 -name '*.{ext}' | wc -l"})


def count_lines(rng: random.Random, home: str = HOME) -> Built:
    path, word = f"{home}/{rng.choice(STEMS)}.txt", rng.choice(WORDS)
    lines = [" ".join(rng.sample(WORDS, 2)) for _ in range(rng.randint(2, 6))]
    if not any(word in line.split() for line in lines):
        lines[rng.randrange(len(lines))] += f" {word}"
    # Lines are words joined by single spaces, so " word " inside " line " is grep -w's whole-word match.
    return Built(_question(f"How many lines of {path} contain the word {word}? Answer with a number.",
                           [*_home(home), _write(path, lines)], f"grep -cw {word} {path}", INTEGER_MATCH),
                 {"grep": f"awk '\" \"$0\" \" ~ / {word} /' {path} | wc -l"})


def find_file(rng: random.Random, home: str = HOME) -> Built:
    folder = f"{home}/{rng.choice(DIRS)}"
    names = [f"{stem}.txt" for stem in rng.sample(STEMS, rng.randint(2, 5))]
    word, *others = rng.sample(WORDS, 4)
    target = rng.choice(names)
    init = [f"mkdir -p {folder}"] + [_write(f"{folder}/{n}", [word if n == target else rng.choice(others)])
                                      for n in names]
    # Each file is one line of one word.
    return Built(_question(f"Which file in {folder} contains the word {word}? Answer with the file name only.",
                           init, f"cd {folder} && grep -lw {word} *", STRING_MATCH),
                 {"grep": f"cd {folder} && awk '$0 == \"{word}\" {{print FILENAME}}' *"})


def _config(rng: random.Random, home: str) -> tuple[str, list[str], int, str, str]:
    path = f"{home}/{rng.choice(('app', 'site', 'db', 'game'))}.conf"
    keys = rng.sample(KEYS, rng.randint(2, 4))
    values = [rng.choice(VALUES) for _ in keys]
    at = rng.randrange(len(keys))
    return path, [f"{k}={v}" for k, v in zip(keys, values)], at, keys[at], values[at]


def read_value(rng: random.Random, home: str = HOME) -> Built:
    path, lines, _, key, _ = _config(rng, home)
    return Built(_question(f"What is the value of {key} in {path}? Answer with the value only.",
                           [*_home(home), _write(path, lines)], f"grep '^{key}=' {path} | cut -d= -f2", STRING_MATCH),
                 {"grep": f"sed -n 's/^{key}=//p' {path}"})


def edit_value(rng: random.Random, home: str = HOME) -> Built:
    path, lines, at, key, old = _config(rng, home)
    new = rng.choice([v for v in VALUES if v != old])
    wanted = [*lines[:at], f"{key}={new}", *lines[at + 1:]]
    expected = "\n".join(wanted)
    return Built(_edit(f"In {path}, change the value of {key} to {new}; leave the other lines as they are.",
                       [*_home(home), _write(path, lines)], f"sed -i 's/^{key}=.*/{key}={new}/' {path}",
                       f"[ \"$(cat {path})\" = {shlex.quote(expected)} ]"),
                 {"sed": f"perl -pi -e 's/^{key}=.*/{key}={new}/' {path}"})


def create_file(rng: random.Random, home: str = HOME) -> Built:
    folder, name, word = f"{home}/{rng.choice(DIRS)}", f"{rng.choice(STEMS)}.txt", rng.choice(WORDS)
    path = f"{folder}/{name}"
    # `echo` is a bash builtin: no tool of this task can go missing.
    return Built(_edit(f"Create the file {path} holding the single line {word}.", [f"mkdir -p {folder}"],
                       f"echo {word} > {path}", f"[ \"$(cat {path})\" = {word} ]"), {})


BUILDERS = {"count_files": count_files, "count_lines": count_lines, "find_file": find_file,
            "read_value": read_value, "edit_value": edit_value, "create_file": create_file}


def declare_variants(built: Built, moved: Built, cwd: str) -> list[dict[str, Any]]:
    """The variants of one task: each missing tool, its files moved (`moved`: the same task drawn
    under another home), its shell started in `cwd`."""
    item = built.item
    return [
        *(os_variants.missing_tool(tool, {"evaluation": {**item["evaluation"], "example": {"code": example}}})
          for tool, example in built.without.items()),
        os_variants.moved_file({field: moved.item[field] for field in os_variants.TASK_FIELDS}),
        os_variants.working_directory(cwd),
    ]


def make_item(split: str, index: int, seed: int) -> dict[str, Any]:
    """The raw AgentBench task object at (seed, split, index) with its `variants`; the six kinds take turns."""
    build = BUILDERS[KINDS[index % len(KINDS)]]
    key = f"os-tier/{seed}/{split}/{index}"
    places = random.Random(f"{key}/variants")
    home, cwd = places.choice(MOVED_HOMES), places.choice(START_DIRECTORIES)
    built = build(random.Random(key))
    moved = build(random.Random(key), home)  # the same draws again: the same task, its files elsewhere
    return {**built.item, "variants": declare_variants(built, moved, cwd)}


def task_only(item: dict[str, Any]) -> dict[str, Any]:
    """A task object without its variant declarations: what makes two tasks the same."""
    return {key: value for key, value in item.items() if key != "variants"}


def _items(split: str, settings: EnvSettings) -> list[dict[str, Any]]:
    """A base split's task objects; easy-dev skips any task that easy-train has word for word."""
    seed = settings.os_tier_seed
    train = [make_item("easy-train", i, seed) for i in range(settings.os_tier_train_tasks)]
    if split == "easy-train":
        return train
    seen = {repr(task_only(item)) for item in train}
    items: list[dict[str, Any]] = []
    index = 0
    while len(items) < settings.os_tier_dev_tasks:
        item = make_item(split, index, seed)
        if repr(task_only(item)) not in seen:
            items.append(item)
        index += 1
    return items


def generate(split: str, settings: EnvSettings) -> list[dict[str, Any]]:
    """A split's tasks as os samples: easy-train, easy-dev, or every variant of theirs in task order."""
    scripts_dir = settings.data_root / SCRIPTS
    base = split.removesuffix(VARIANTS_SUFFIX)
    items = _items(base, settings)
    if split == base:
        return [parse_task(item, scripts_dir, f"{split}-{i:05d}") for i, item in enumerate(items)]
    samples: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        for variant in os_variants.variants_of(item):
            sample = parse_task(os_variants.variant_item(item, variant), scripts_dir,
                                os_variants.variant_id(f"{base}-{i:05d}", variant))
            samples.append({**sample, "variant": os_variants.session_fields(variant)})
    return samples
