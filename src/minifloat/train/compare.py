"""Train one model under several recipes and compare them: loss curves, a table, JSON.

Every recipe sees the same model preset, data, seed and batches, so the curves differ only by
numerics. The first recipe is the reference the gaps are measured against (e.g. bf16). A run with
a final-phase precision switch is named ``RECIPE+switch=SWITCH+at=F`` (switch.py), e.g.
``fp4+switch=bf16+at=0.9`` next to ``fp4`` and ``bf16``. When its plain run (``fp4``) is in the
comparison too, that run checkpoints at the switch step and the switched run branches from there
(branch.py): it trains only the steps after the switch, with the same result.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minifloat import recipes
from minifloat.train.build import check_names, load_dataset
from minifloat.train.config import TrainConfig
from minifloat.train.errors import ConfigError, RunFailed
from minifloat.train.model import check_quantizes_a_layer
from minifloat.train.result import TrainResult
from minifloat.train.switch import numerics_key, parse_run_name, run_name
from minifloat.train.trainer import train

__all__ = ["CompareResult", "compare", "markdown_table", "plot_losses"]


@dataclass(frozen=True, kw_only=True)
class CompareResult:
    """Per-recipe results plus the paths of the written plot, table and JSON."""

    results: tuple[TrainResult, ...]
    table: str
    plot_path: Path
    markdown_path: Path
    json_path: Path


def _gap_percent(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return 100.0 * (value - reference) / reference


def _rows(results: Sequence[TrainResult]) -> list[dict[str, Any]]:
    ref = results[0]
    rows = []
    for r in results:
        rows.append(
            {
                "recipe": r.recipe,
                "final_train_loss": r.final_loss,
                "final_val_loss": r.final_val_loss,
                "train_gap_percent": _gap_percent(r.final_loss, ref.final_loss),
                "val_gap_percent": _gap_percent(r.final_val_loss, ref.final_val_loss),
                "tokens_per_s": r.tokens_per_s,
                "peak_memory_bytes": r.peak_memory_bytes,
                "skipped_steps": r.skipped_steps,
                "steps": r.steps,
            }
        )
        if r.switch_recipe is not None:
            rows[-1].update(switch_recipe=r.switch_recipe, switch_at=r.switch_at)
        if r.branched_from is not None:  # the plain run's name: its directory's
            rows[-1].update(branched_from=Path(r.branched_from).name, branch_step=r.branch_step)
    return rows


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown_table(results: Sequence[TrainResult]) -> str:
    """Markdown table of final losses, gaps to the first recipe, speed and memory."""
    ref = results[0].recipe
    lines = [
        f"| recipe | train loss | val loss | gap vs {ref} (train) | gap vs {ref} (val) "
        "| tokens/s | peak memory | skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in _rows(results):
        mem = row["peak_memory_bytes"]
        lines.append(
            f"| {row['recipe']} | {_num(row['final_train_loss'], '.4f')} "
            f"| {_num(row['final_val_loss'], '.4f')} "
            f"| {_num(row['train_gap_percent'], '+.2f')}% "
            f"| {_num(row['val_gap_percent'], '+.2f')}% "
            f"| {row['tokens_per_s']:.0f} "
            f"| {'n/a (CPU)' if mem is None else f'{mem / 2**30:.2f} GiB'} "
            f"| {row['skipped_steps']} |"
        )
    for row in _rows(results):
        if "branched_from" in row:
            lines.append(
                f"\n{row['recipe']}: branched from {row['branched_from']} at step "
                f"{row['branch_step']} (the steps up to it are that run's; its tokens/s and "
                "peak memory are of the steps it trained itself)"
            )
    return "\n".join(lines)


def _smooth(values: Sequence[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (makes per-batch noise readable)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def plot_losses(results: Sequence[TrainResult], path: Path, *, title: str = "") -> Path:
    """Write a PNG of smoothed training-loss curves (lines) and validation losses (markers)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for r in results:
        steps = range(1, len(r.losses) + 1)
        (line,) = ax.plot(steps, _smooth(r.losses), label=f"{r.recipe} (train)", linewidth=1.5)
        if r.val_losses:
            xs, ys = zip(*r.val_losses, strict=True)
            ax.plot(xs, ys, "o--", color=line.get_color(), markersize=4, linewidth=0.8,
                    label=f"{r.recipe} (val)")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title or "training loss by recipe")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _run_configs(recipe_names: Sequence[str], base: TrainConfig) -> dict[str, TrainConfig]:
    """{run name: its config} of ``recipe_names`` (switch.py's names); a bad, unknown or
    repeated name raises :class:`ConfigError` before any data or training work."""
    if isinstance(recipe_names, str):  # iterated, "bf16,fp4" was the recipes 'b', 'f', ...
        raise ConfigError(f"compare takes a list of recipes, e.g. {recipe_names.split(',')}")
    if not recipe_names:
        raise ConfigError("compare needs at least one recipe")
    if base.switch_recipe is not None or base.switch_at is not None:
        raise ConfigError(
            "compare takes a switch per run, in its name (e.g. --recipes "
            "bf16,fp4,fp4+switch=bf16+at=0.9), not switch-recipe/switch-at for every run"
        )
    if base.branch_from is not None:
        raise ConfigError(
            "compare branches a switched run from its plain run itself; branch-from is a "
            "setting of train"
        )
    configs: dict[str, TrainConfig] = {}
    same: dict[tuple, str] = {}  # what a run computes -> its name
    for name in recipe_names:
        fields = parse_run_name(name)
        try:
            config = dataclasses.replace(base, **fields)
        except ConfigError as exc:
            raise ConfigError(f"run {name}: {exc}") from None
        check_names(config)
        label = run_name(config.recipe, config.switch_recipe, config.switch_at)
        if label in configs:
            raise ConfigError(
                f"recipe {label} is named more than once; each recipe trains once, in its own "
                "directory"
            )
        key = tuple(
            None if r is None else numerics_key(recipes.get(r))
            for r in (config.recipe, config.switch_recipe)
        ) + (config.switch_at,)
        if key in same:  # e.g. fp4:dge.k=5 is fp4: it would train twice
            raise ConfigError(f"run {label} computes exactly as run {same[key]}: name it once")
        same[key] = label
        check_quantizes_a_layer(config)
        configs[label] = config
    return configs


def _branches(configs: dict[str, TrainConfig], out: Path) -> dict[str, TrainConfig]:
    """``configs`` with every switched run whose plain run is among them branching from it,
    and that plain run checkpointing at each such switch step (and at its end), nowhere else;
    plain runs come first, so their checkpoints exist when their switched runs start."""
    configs, sources, branched = dict(configs), {}, {}
    for name, config in configs.items():
        plain = configs.get(config.recipe)
        if config.switch_at is not None and plain is not None and plain.switch_recipe is None:
            sources.setdefault(config.recipe, []).append(config.switch_at)
            branched[name] = dataclasses.replace(config, branch_from=str(out / config.recipe))
    for name, points in sources.items():
        configs[name] = dataclasses.replace(
            configs[name], save_checkpoints=True, ckpt_every=0, ckpt_at=tuple(points),
            keep_checkpoints=len(points) + 1,
        )  # fmt: skip
    first = {name: config for name, config in configs.items() if name not in branched}
    return {**first, **branched}


def compare(
    recipe_names: Sequence[str],
    base: TrainConfig,
    *,
    out_dir: str | Path,
    progress: bool | str = "auto",
    branch: bool = True,
) -> CompareResult:
    """Train ``base`` under each recipe (same data, seed, batches); write plot, table, JSON.

    A name is a recipe (or variant), or ``RECIPE+switch=SWITCH+at=F`` for a run with a
    final-phase switch (switch.py). Each run trains in ``out_dir/<name>``, so a run may be named
    once only. With ``branch`` a switched run whose plain run is compared too starts from that
    run's checkpoint at the switch step (:func:`_branches`); the plain run keeps those
    checkpoints. A run that fails (RunFailed: most steps skipped) still gets its row; the others
    train on, and RunFailed naming the failed runs is raised after everything is written.
    Every run trains from scratch: ``base.resume`` is ignored (with a warning), and only the
    checkpoints that branching needs are saved.
    """
    if base.resume:
        warnings.warn(
            "compare trains every run from scratch: base.resume=True is ignored", stacklevel=2
        )
    base = dataclasses.replace(base, save_checkpoints=False, resume=False).resolved()
    configs = _run_configs(recipe_names, base)
    out = Path(out_dir)
    dataset = load_dataset(base, progress=progress is not False and progress != "off")
    done, failed = {}, []
    for name, config in (_branches(configs, out) if branch else configs).items():
        config = dataclasses.replace(config, out_dir=str(out / name))
        try:
            done[name] = train(config, dataset=dataset, progress=progress)
        except RunFailed as exc:
            if exc.result is None:
                raise
            done[name] = exc.result
            failed.append(f"{name}: {exc}")
    results = [done[name] for name in configs]
    table = markdown_table(results)
    plot_path = plot_losses(
        results,
        out / "loss_curves.png",
        title=f"{base.model} on {base.data}, {results[0].steps} steps, seed {base.seed}",
    )
    markdown_path = out / "comparison.md"
    markdown_path.write_text(
        f"# Recipe comparison: {base.model} on {base.data}\n\n{table}\n\n"
        f"![loss curves]({plot_path.name})\n"
    )
    json_path = out / "comparison.json"
    summary = {
        "config": base.to_dict(),
        "reference": results[0].recipe,
        "results": _rows(results),
        "losses": {r.recipe: list(r.losses) for r in results},
        "val_losses": {r.recipe: [list(v) for v in r.val_losses] for r in results},
    }
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    if failed:
        raise RunFailed(
            f"{len(failed)} of {len(results)} runs failed ({'; '.join(failed)}); the comparison "
            f"is in {markdown_path}"
        )
    return CompareResult(
        results=tuple(results),
        table=table,
        plot_path=plot_path,
        markdown_path=markdown_path,
        json_path=json_path,
    )
