"""Maps a family name to its `Family` record, and (family, split) to samples addressed by index.

Each family module exposes `FAMILY: Family`. A new family is one line in `FAMILY_MODULES`; modules
are imported only when their family is asked for, so a family with heavy dependencies (sandboxes)
costs nothing to the others.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from env_workers.envs.base import EnvSettings, Environment, Family

FAMILY_MODULES: dict[str, str] = {
    "calc": "env_workers.envs.calc",
    "db": "env_workers.envs.db",
    "kg": "env_workers.envs.kg",
    "os": "env_workers.envs.os_env",
    "python": "env_workers.envs.python_env",
    "webshop": "env_workers.envs.webshop",
    "alfworld": "env_workers.envs.alfworld",
}


class UnknownFamily(KeyError):
    """A family or split name that no module provides."""

    def __str__(self) -> str:
        return str(self.args[0])


def family_names() -> list[str]:
    return sorted(FAMILY_MODULES)


def family(name: str) -> Family:
    """The family record, importing its module on first use."""
    module_name = FAMILY_MODULES.get(name)
    if module_name is None:
        raise UnknownFamily(f"unknown family {name!r}; known: {', '.join(family_names())}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise UnknownFamily(f"family {name!r} is not installed (module {module_name} is missing)") from error
    return module.FAMILY


def environment(name: str, settings: EnvSettings) -> Environment:
    return family(name).make(settings)


def split_names(name: str) -> list[str]:
    return sorted(family(name).splits)


@cache
def _samples(name: str, split: str, settings: EnvSettings) -> tuple[dict[str, Any], ...]:
    spec = family(name)
    if split not in spec.splits:
        raise UnknownFamily(f"family {name!r} has no split {split!r}; splits: {', '.join(split_names(name))}")
    files = spec.splits[split]
    if not files and spec.generate is not None:
        return tuple(spec.generate(split, settings))
    return tuple(sample for relative in files for sample in spec.load(settings.data_root / relative))


def samples(name: str, split: str, settings: EnvSettings) -> tuple[dict[str, Any], ...]:
    """All samples of a split, in file order (cached per process: every index resolves the same way)."""
    return _samples(name, split, settings)


def sample(name: str, split: str, index: int, settings: EnvSettings) -> dict[str, Any]:
    """The sample at `index` (0-based, in file order); IndexError past the end."""
    pool = samples(name, split, settings)
    if not 0 <= index < len(pool):
        raise IndexError(f"family {name!r} split {split!r} has {len(pool)} samples; no index {index}")
    return pool[index]
