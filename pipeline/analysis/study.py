"""A study's results: one configuration run under several seeds and variants, side by side.

Pure: takes each run's summary.json (pipeline/analysis/report.py: per task `before`, `after` and the
paired `change` with `mean` and `ci95`) and computes, per variant and task family, how many seeds
improved or got worse outside the noise and the mean change over seeds; draws one PNG figure.
`rollstream study` (pipeline/run/study.py) runs the study and writes what this computes.

A seed counts as improved when its paired change's 95% interval lies above zero and the paired sign-flip
test agrees (worse: below), the rule each run's report judges by (pipeline/analysis/evaluation.py). A seed
whose run failed, or whose report has no paired change for a family (a single validation round, fewer than
two paired samples), does not count for that family.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pipeline.analysis.evaluation import paired_decision

RunRecord = Mapping[str, Any]
"""One run of a study: {"variant", "seed", "run"} and either "summary" (its summary.json) or "error"."""


def seed_changes(runs: Sequence[RunRecord], variant: str) -> dict[str, list[dict[str, Any]]]:
    """family -> the paired change of each seed of `variant` whose report has one, in seed order:
    {"seed", "run", "mean", "ci95", "samples"}."""
    out: dict[str, list[dict[str, Any]]] = {}
    mine = sorted((r for r in runs if r["variant"] == variant and r.get("summary")), key=lambda r: r["seed"])
    for record in mine:
        for family, row in sorted(record["summary"].get("tasks", {}).items()):
            change = row.get("change")
            if change is None:
                continue
            out.setdefault(family, []).append({"seed": record["seed"], "run": record["run"], "mean": change["mean"],
                                               "ci95": list(change["ci95"]), "samples": change.get("samples"),
                                               "p_sign_flip": change.get("p_sign_flip")})
    return out


def family_result(changes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One family of one variant: seeds, seeds_improved (evaluation.paired_decision), seeds_worse,
    mean_change (mean over seeds of the change's mean; None without a seed) and the per-seed changes."""
    return {"seeds": len(changes),
            "seeds_improved": sum(paired_decision(c) == "improved" for c in changes),
            "seeds_worse": sum(paired_decision(c) == "worse" for c in changes),
            "mean_change": statistics.fmean(c["mean"] for c in changes) if changes else None,
            "changes": [dict(c) for c in changes]}


def aggregate(runs: Sequence[RunRecord], variants: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """variant -> family -> family_result, for every variant of `variants` (one whose runs all failed: {})."""
    return {variant: {family: family_result(changes) for family, changes in seed_changes(runs, variant).items()}
            for variant in variants}


def run_row(record: RunRecord) -> dict[str, Any]:
    """What study.json lists of one run: who it is and how it ended (not its whole summary)."""
    row = {key: record.get(key) for key in ("variant", "seed", "run", "outcome", "duration_s")}
    if record.get("error"):
        row["error"] = record["error"]
    return row


def study_document(study: str, config: str | None, seeds: Sequence[int],
                   variants: Mapping[str, Mapping[str, Any]], runs: Sequence[RunRecord], *,
                   figure: str | None = None, interrupted: bool = False) -> dict[str, Any]:
    """study.json: the study, its seeds and variants (name -> configuration overrides), `results`
    (variant -> family -> seeds, seeds_improved, seeds_worse, mean_change, changes), every run, and
    the failed ones with their error."""
    return {"study": study, "config": config, "seeds": list(seeds),
            "variants": {name: dict(overrides) for name, overrides in variants.items()},
            "results": aggregate(runs, list(variants)), "runs": [run_row(r) for r in runs],
            "failed": [run_row(r) for r in runs if r.get("error")], "figure": figure, "interrupted": interrupted}


def table_rows(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[list[str]]:
    """[variant, family, "improved / worse of seeds", "mean change"] per variant and family, for a text table."""
    rows = []
    for variant, families in results.items():
        for family, r in families.items():
            mean = "—" if r["mean_change"] is None else f"{100 * r['mean_change']:+.1f} pp"
            rows.append([variant, family, f"{r['seeds_improved']} / {r['seeds_worse']} of {r['seeds']}", mean])
        if not families:
            rows.append([variant, "—", "no run with a paired change", "—"])
    return rows


def plot_study(results: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Path, dpi: int = 120) -> bool:
    """study.png: one panel per family; in it, per variant, each seed's paired change with its 95%
    interval, and the variant's mean over seeds. False (nothing written) when no family has a change."""
    families = sorted({f for fams in results.values() for f, r in fams.items() if r["changes"]})
    if not families:
        return False
    variants = list(results)
    fig = Figure(figsize=(max(4.0, 1.2 * len(variants) + 1.5) * len(families), 4.0), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(families), squeeze=False, sharey=True)[0]
    for ax, family in zip(axes, families):
        labelled: set[int] = set()  # one legend entry per seed
        for x, variant in enumerate(variants):
            row = results[variant].get(family)
            if not row or not row["changes"]:
                continue
            changes = row["changes"]
            width = 0.6 / max(1, len(changes))
            for k, c in enumerate(changes):
                at = x - 0.3 + width * (k + 0.5)
                ax.errorbar([at], [100 * c["mean"]], yerr=[[100 * (c["mean"] - c["ci95"][0])],
                                                           [100 * (c["ci95"][1] - c["mean"])]],
                            fmt="o", color=f"C{c['seed'] % 10}", capsize=3,
                            label=None if c["seed"] in labelled else f"seed {c['seed']}")
                labelled.add(c["seed"])
            ax.hlines(100 * row["mean_change"], x - 0.35, x + 0.35, colors="black", linewidth=2)
        ax.axhline(0.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(variants)), variants, rotation=20)
        ax.set_xlim(-0.6, len(variants) - 0.4)
        ax.set_title(family)
    axes[0].set_ylabel("held-out success change, paired [95% CI] (pp)")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(handles, labels, fontsize="small", loc="best")
    fig.suptitle("Change per seed (points) and mean over seeds (bar), per variant")
    fig.savefig(path)
    return True
