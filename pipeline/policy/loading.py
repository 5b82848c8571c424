"""Loading a policy: a Hugging Face checkpoint with its frozen reference copy (the learner), its chat
template's fingerprint, and a servable checkpoint of a version a run staged in the object store
(`rollstream eval --checkpoint VERSION`, engines restarted by `rollstream up`)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from learner.manifest import ShardIntegrityError, read_version
from learner.publish import manifest_uri
from pipeline.engine.updates import download_version
from pipeline.policy.sft import WEIGHT_SUFFIXES
from pipeline.run.config import RollstreamConfig
from schemas import objectstore
from schemas.template import template_fingerprint


def load_policy(path: Path) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, Any]]:
    """The policy (float32, CPU) from a Hugging Face checkpoint, its frozen reference copy, and
    its config as config.json holds it."""
    from transformers import AutoModelForCausalLM  # heavy import, only when a model is loaded

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    return model, ref, json.loads(model.config.to_json_string())


def policy_template(path: Path) -> str | None:
    """The chat-template fingerprint of the policy's tokenizer; None for a checkpoint without one."""
    from transformers import AutoTokenizer

    if not (path / "tokenizer_config.json").is_file():
        return None
    return template_fingerprint(AutoTokenizer.from_pretrained(str(path)))


class VersionUnavailable(RuntimeError):
    """A staged version that is damaged or no longer in the object store."""


def materialize_version(cfg: RollstreamConfig, run: str, version: int, base: Path, out: Path) -> Path:
    """A servable checkpoint of a run's staged version: `base`'s tokenizer and config, the version's weights.
    Raises VersionUnavailable when the object store has no intact copy of it."""
    event = {"manifest_uri": manifest_uri(run, version), "version": version, "shards": []}
    staged = out / "staged"
    try:
        download_version(objectstore.client(cfg.object_store), event, staged)
        _, tensors = read_version(staged)
    except ShardIntegrityError as error:
        raise VersionUnavailable(f"version {version} of run {run} is damaged: {error}") from None
    except Exception as error:  # the object store answers a missing (pruned) version with S3Error
        raise VersionUnavailable(f"version {version} of run {run} is not in the object store ({error}); the "
                                 f"learner keeps only the latest versions: use a checkpoint directory instead") from None
    model_dir = out / f"v{version:06d}"
    model_dir.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, model_dir / path.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.rmtree(staged)
    return model_dir
