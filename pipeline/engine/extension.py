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
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from learner.broadcast import receive_buckets
from learner.manifest import read_version
from pipeline.engine.updates import weight_sync_group
from schemas.weight_layout import TensorSpec, plan_buckets


class WeightUpdateExtension:
    """Mixed into vLLM's worker: `self` is the worker (it has reload_weights and model_runner)."""

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
        try:
            self._reload(tensors.items())
        except Exception as error:  # noqa: BLE001
            return {"ok": False, "error": f"loading {path} failed: {error!r}"}
        return {"ok": True, "version": manifest.version, "tensors": len(tensors), "read_s": read - started,
                "load_s": time.perf_counter() - read}
