"""The learning curve of a run, from the manifests alone: a table and a PNG plot.

`mtrl report RUNS_DIR` follows the newest policy back to the starting model and reports one
row per iteration: rollout metrics (assign-rewards), training metrics (ppo-update) and the
time its stages took.
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path
from typing import Any

from pipeline.store.lineage import iteration_versions
from pipeline.store.versions import Store
from runtime.files import replace_file
from schemas.manifest import Manifest
from schemas.stage import POLICY

COLUMNS = (  # (key, header, width, decimals)
    ("iteration", "iter", 4, 0),
    ("success_rate", "success", 7, 3),
    ("reward_mean", "reward", 7, 3),
    ("mean_turns", "turns", 6, 2),
    ("mean_turns_to_solve", "solve t", 7, 2),  # mean turns of the solved rollouts
    ("mean_turns_to_solve_or_limit", "solve|lim", 9, 2),  # unsolved rollouts counted at the turn limit
    ("mean_gen_tokens_per_rollout", "gen tok", 7, 1),
    ("policy_loss", "pg loss", 8, 4),
    ("kl", "kl", 7, 4),
    ("entropy", "entropy", 7, 3),
    ("clip_fraction", "clip", 6, 3),
    ("stage_seconds", "stage s", 7, 1),
)


def iteration_row(made: list[Manifest]) -> dict[str, Any]:
    """One iteration's row of the report, from the versions it made (iteration_versions)."""
    update, rewards = made[0], next(m for m in made if m.stage == "assign-rewards")
    return {
        "iteration": update.iteration,
        "policy": update.parents[POLICY],
        **rewards.metrics,
        **{k: v for k, v in update.metrics.items() if k in ("policy_loss", "kl", "entropy", "clip_fraction")},
        "stage_seconds": sum(m.wall_s for m in made),
    }


def iterations(store: Store, policy_version: str | None = None) -> list[dict[str, Any]]:
    """One row per iteration of the lineage ending at `policy_version` (default: the newest)."""
    return [iteration_row(made) for made in iteration_versions(store, policy_version)]


def table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any, width: int, decimals: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.{decimals}f}"

    lines = [" ".join(f"{title:>{width}}" for _, title, width, _ in COLUMNS)]
    lines += [" ".join(cell(row.get(key), width, decimals) for key, _, width, decimals in COLUMNS) for row in rows]
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The same table in GitHub-flavoured markdown (what the Prefect UI renders as a table)."""
    headers = [title.replace("|", "\\|") for _, title, _, _ in COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(COLUMNS)]
    for row in rows:
        cells = ["-" if row.get(key) is None else f"{row[key]:.{decimals}f}" for key, _, _, decimals in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PLOT_COLORS = 64  # a palette PNG: about a third of the bytes of a full-colour one, and looks the same


def plot_png(rows: list[dict[str, Any]]) -> bytes:
    """The learning curve as PNG bytes, small enough to embed in a summary artifact. The same
    rows are drawn once per process (a run's end publishes the plot, then `mtrl run` prints it)."""
    return _plot_png(json.dumps(rows, sort_keys=True))


@functools.lru_cache(maxsize=1)
def _plot_png(rows_json: str) -> bytes:
    rows = json.loads(rows_json)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    x = [row["iteration"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(x, [row.get("success_rate") for row in rows], marker="o", label="success rate")
    left.plot(x, [row.get("reward_mean") for row in rows], marker=".", linestyle="--", label="mean reward")
    left.set(xlabel="iteration", ylim=(-0.02, 1.02), title="rollouts")
    left.legend()
    right.plot(x, [row.get("mean_turns") for row in rows], marker="o", label="mean turns")
    right.plot(x, [row.get("mean_turns_to_solve") for row in rows], marker=".", label="mean turns when solved")
    right.plot(
        x,
        [row.get("mean_turns_to_solve_or_limit") for row in rows],
        marker="x",
        label="turns to solve (unsolved = limit)",
    )
    right.set(xlabel="iteration", title="episode length")
    right.legend()
    # fixed margins that fit these labels: tight_layout measured every text first (a third of the plot's time)
    figure.subplots_adjust(left=0.05, right=0.99, bottom=0.13, top=0.92, wspace=0.15)
    rendered = io.BytesIO()
    figure.savefig(rendered, dpi=100, format="png")
    plt.close(figure)
    palette = Image.open(rendered).convert("RGB").quantize(colors=PLOT_COLORS)
    compressed = io.BytesIO()
    palette.save(compressed, format="PNG", optimize=True)
    return compressed.getvalue()


def write_files(rows: list[dict[str, Any]], out_dir: Path, plot: bool = True) -> Path:
    """summary.json and (with `plot`) learning_curve.png in out_dir; returns the PNG's path."""
    files = {"summary.json": (json.dumps(rows, indent=2) + "\n").encode()}
    if plot:
        files["learning_curve.png"] = plot_png(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        replace_file(out_dir / name, data)
    return out_dir / "learning_curve.png"


def write_report(store: Store, out_dir: Path | None = None, policy_version: str | None = None) -> tuple[str, Path]:
    """Print-ready table; writes learning_curve.png and summary.json into out_dir."""
    rows = iterations(store, policy_version)
    return table(rows), write_files(rows, out_dir or store.root / "report")
