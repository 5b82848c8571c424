"""A small randomly initialized policy for the benchmarks that measure the pipeline, not learning.

SFT would only cost minutes before a benchmark whose figures do not depend on what the policy has
learned; the tokenizer is bytes-only, since learning merges would run the environments first and
the benchmarks' figures so far were measured on byte-level sequences.
"""

from __future__ import annotations

from pathlib import Path


def ensure_random_policy(path: Path) -> None:
    """A randomly initialized small policy at `path` when there is none (a policy already there is
    left as it is)."""
    if (path / "config.json").is_file():
        return
    from pipeline.policy.model_init import PolicyModelSettings, init_model  # torch: only when a policy is made

    init_model(PolicyModelSettings(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                                   intermediate_size=256, vocab_size=256), path)
