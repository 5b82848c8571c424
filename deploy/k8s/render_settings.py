"""Writes the component settings files of deploy/k8s/config/ from deploy/k8s/config/run.yaml.

The streams worker, the env workers and the learner take their whole settings as JSON (`--settings`),
as `rollstream up` gives them (pipeline/run/plan.py); on Kubernetes they come from the ConfigMap that
kustomization.yaml generates from these files. Run it after editing run.yaml:

    PYTHONPATH=. .venv/bin/python deploy/k8s/render_settings.py

The files are derived from run.yaml alone: ROLLSTREAM_* and the infrastructure scripts' variables of the
machine it runs on are ignored (the pods get theirs from connection.yaml and the Secret).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG_DIR = HERE / "config"
RUN_YAML = CONFIG_DIR / "run.yaml"
MODEL_DIR = Path("/models/policy")
"""Where the pods mount the policy checkpoint (the rollstream-policy volume)."""

# Variables load_config reads (pipeline/run/config.py): left out while the files are derived.
_READ_BY_CONFIG = ("ROLLSTREAM_", "KAFKA_HOST", "KAFKA_PORT", "MINIO_", "MARIADB_")


@contextmanager
def _without_local_environment():
    saved = {k: v for k, v in os.environ.items() if k.startswith(_READ_BY_CONFIG)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def load_run_config(path: Path = RUN_YAML):
    """The run configuration of `path`, without this machine's environment."""
    from pipeline.run.config import load_config

    with _without_local_environment():
        return load_config(path)


def settings_files(path: Path = RUN_YAML) -> dict[str, str]:
    """{file name: content} of the settings `rollstream up` would give each component for `path`."""
    from pipeline.run.plan import component_settings

    return component_settings(load_run_config(path), MODEL_DIR)


def main() -> None:
    for name, content in settings_files().items():
        (CONFIG_DIR / name).write_text(content)
        print(f"wrote {CONFIG_DIR / name}", file=sys.stderr)


if __name__ == "__main__":
    main()
