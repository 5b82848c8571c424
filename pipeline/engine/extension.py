"""The vLLM worker extension (`--worker-extension-cls pipeline.engine.extension.WeightUpdateExtension`):
methods vLLM mixes into its worker, called through `collective_rpc` from the API server process.

Every method returns a plain dict ({"ok": True, ...} or {"ok": False, "error": ...}) instead of
raising, so a refused update (a corrupted shard) comes back as a message and never takes the
engine core down. Weights go through the worker's `reload_weights(weights_iterator=...)`, which
maps Hugging Face names onto vLLM's fused layers and redoes any kernel-format processing.

Tied embeddings (the default policy ties lm_head to embed_tokens): vLLM 0.32's in-place reload
loads the new values into embed_tokens, but sees lm_head as a layer with nothing to load
("ParallelLMHead: Failed to load weights") and never reprocesses it, so on CPU, where lm_head's
GEMM uses a copy prepacked at start-up, the logits kept coming from the OLD embedding (greedy
output differed from torch's). `_retie_embeddings` makes sure the two share one parameter and
redoes lm_head's kernel-format processing after every load. The learner publishes a tied tensor
once, as model.embed_tokens.weight (learner/publish.py), so every update reaches lm_head only
through this re-tie.

Held weights (pipeline/engine/updates.py, "In-memory path"): after loading a version directory the
worker keeps its tensors, verified, in host memory, one more copy of the weights per worker (off
with `EngineSettings.hold_weights`). A delta version is then applied on them here and loaded, without
rebuilding it on disk. A broadcast-loaded version is not held (it would cost a device-to-host copy on
every update of the fast path); the next staged delta on such an engine is rebuilt by the supervisor.
Every tensor is loaded, not only the changed ones: at RL learning rates Adam moves a few weights of
nearly every tensor, and vLLM's fused layers (qkv, gate_up) are reprocessed as a whole anyway.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from learner.broadcast import receive_buckets
from learner.delta import apply_delta
from learner.manifest import read_version
from pipeline.engine.updates import read_delta_link, weight_sync_group
from schemas.weight_layout import TensorSpec, plan_buckets


# Set to "0" by the supervisor when the engine must not keep a host copy of its weights (EngineSettings.hold_weights).
HOLD_WEIGHTS_ENV = "ROLLSTREAM_ENGINE_HOLD_WEIGHTS"


@dataclass(frozen=True)
class HeldWeights:
    """The version the worker serves, as the verified tensors it was loaded from, with their sha256."""

    version: int
    tensors: dict[str, torch.Tensor]
    checksums: dict[str, str]


class WeightUpdateExtension:
    """Mixed into vLLM's worker: `self` is the worker (it has reload_weights and model_runner)."""

    _rollstream_held: HeldWeights | None = None

    def _hold(self, held: HeldWeights | None) -> None:
        self._rollstream_held = held if os.environ.get(HOLD_WEIGHTS_ENV, "1") != "0" else None

    def _weights_device(self) -> torch.device:
        return next(self.model_runner.model.parameters()).device  # type: ignore[attr-defined]

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
        self._retie_embeddings()

    def _retie_embeddings(self) -> None:
        model = self.model_runner.model  # type: ignore[attr-defined]
        config = self.model_runner.model_config.hf_text_config  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
            return
        if lm_head.weight is not embed.weight:
            lm_head.weight = embed.weight
        # Always: lm_head's prepacked copy was made from the old embedding.
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def rollstream_join(self, host: str, port: int, rank: int, world_size: int, backend: str,
                        timeout_s: float = 300.0) -> dict[str, Any]:
        """Joins the weight-sync group; blocks until every rank has joined, at most `timeout_s`.

        The worker serves no request while it waits, so the learner asks for a short timeout."""
        try:
            self._rollstream_group = weight_sync_group(host, port, rank=rank, world_size=world_size, backend=backend,
                                                       timeout_s=timeout_s)
        except Exception as error:  # noqa: BLE001 - reported to the caller, the engine keeps serving
            return {"ok": False, "error": f"joining the weight-sync group failed: {error!r}"}
        return {"ok": True, "rank": rank, "world_size": world_size}

    def rollstream_receive(self, specs: list[dict[str, Any]], bucket_size_bytes: int, src: int) -> dict[str, Any]:
        """Receives every bucket of the layout, then loads the tensors."""
        group = getattr(self, "_rollstream_group", None)
        if group is None:
            return {"ok": False, "error": "not in a weight-sync group: call /rollstream/join first"}
        started = time.perf_counter()
        try:
            buckets = plan_buckets([TensorSpec.model_validate(s) for s in specs], bucket_size_bytes)
            # Everything is received before loading starts, so a failing load can never leave
            # the sender blocked on a bucket nobody receives (costs one copy of the weights).
            tensors = list(receive_buckets(buckets, src=src, device=self._weights_device(), group=group))
            received = time.perf_counter()
            self._hold(None)  # from here the served weights are no longer the held ones
            self._reload(tensors)
        except Exception as error:  # noqa: BLE001
            return {"ok": False, "error": f"broadcast update failed: {error!r}"}
        return {"ok": True, "tensors": len(tensors), "receive_s": received - started,
                "load_s": time.perf_counter() - received}

    def rollstream_load_dir(self, path: str) -> dict[str, Any]:
        """Loads a version directory (shards + manifest), every shard's sha256 checked first."""
        started = time.perf_counter()
        try:
            manifest, tensors = read_version(Path(path))
        except Exception as error:  # noqa: BLE001 - nothing was loaded: the old version stays
            return {"ok": False, "error": f"version at {path} refused: {error}"}
        read = time.perf_counter()
        self._hold(None)
        try:
            self._reload(tensors.items())
        except Exception as error:  # noqa: BLE001
            return {"ok": False, "error": f"loading {path} failed: {error!r}"}
        # read_version checked every shard against the manifest, so its tensor sha256s are the tensors'.
        self._hold(HeldWeights(manifest.version, tensors,
                               {t.name: t.sha256 for t in manifest.tensors if t.sha256 is not None}))
        return {"ok": True, "version": manifest.version, "tensors": len(tensors), "read_s": read - started,
                "load_s": time.perf_counter() - read}

    def rollstream_apply_deltas(self, paths: list[str]) -> dict[str, Any]:
        """Applies delta links (directories of updates.write_delta_link, oldest first) on the held
        version, every result tensor's sha256 checked, then loads the result. Refused, with nothing
        loaded, when the worker holds no version or not the first link's base."""
        started = time.perf_counter()
        held = self._rollstream_held
        try:
            links = [read_delta_link(Path(p)) for p in paths]
            if not links:
                raise ValueError("no delta to apply")
            if held is None:
                raise ValueError("this worker holds no weights to apply a delta on (loaded by broadcast, or at start-up)")
            if links[0][0].base_version != held.version:
                raise ValueError(f"the first delta is on version {links[0][0].base_version}, this worker holds "
                                 f"version {held.version}")
            tensors, checksums, version = held.tensors, held.checksums, held.version
            for manifest, shards in links:
                if manifest.base_version != version:
                    raise ValueError(f"delta {manifest.version} is on version {manifest.base_version}, not {version}")
                tensors, checksums = apply_delta(tensors, manifest, shards, base_checksums=checksums,
                                                 workers=len(os.sched_getaffinity(0)))
                version = manifest.version
        except Exception as error:  # noqa: BLE001 - nothing was loaded: the old version stays
            return {"ok": False, "error": f"delta refused: {error}", "held_version": held.version if held else None}
        applied = time.perf_counter()
        self._hold(None)
        try:
            self._reload(tensors.items())
        except Exception as error:  # noqa: BLE001
            return {"ok": False, "error": f"loading version {version} failed: {error!r}", "held_version": None}
        self._hold(HeldWeights(version, tensors, checksums))
        return {"ok": True, "version": version, "deltas": len(links), "tensors": len(tensors),
                "apply_s": applied - started, "load_s": time.perf_counter() - applied}
