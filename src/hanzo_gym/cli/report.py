"""`gym report RUN_DIR...`: what a run did, in a few lines, and its curves in one picture.

It reads only the run directory's records (metrics.jsonl, run_config.json, checkpoints.jsonl), so it works on a
run that is still going, one that was interrupted, and one copied off a cluster; it loads no torch. Several runs
share each chart, so two configs compare at a glance.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from hanzo_gym.clock import duration
from hanzo_gym.errors import GymError
from hanzo_gym.files import read_jsonl

# The charts, in this order, for whichever of these metrics a run logged; a chart may hold a training metric and
# its eval counterpart. Any other eval/ metric gets a chart of its own after these.
CHARTS = (
    ("loss", ("loss", "eval/loss")),
    ("reward", ("reward", "eval/reward")),
    ("rewards/margins", ("rewards/margins", "eval/rewards/margins")),
    ("rewards/accuracies", ("rewards/accuracies", "eval/rewards/accuracies")),
    ("learning rate", ("lr",)),
    ("grad_norm", ("grad_norm",)),
    ("kl", ("kl",)),
    ("completions/mean_length", ("completions/mean_length",)),
    ("tokens/s", ("tokens_per_s",)),
)
MOST_CHARTS = 12
FINAL_OUTPUTS = ("adapter_config.json", "model.safetensors")  # the last file a finished run writes


@dataclass
class RunRecord:
    path: Path
    rows: list[dict]
    config: dict
    checkpoints: list[str]

    @classmethod
    def read(cls, path: str | Path) -> RunRecord:
        path = Path(path)
        if not (path / "metrics.jsonl").is_file():
            what = "does not exist" if not path.exists() else "has no metrics.jsonl"
            raise GymError(f"{path} {what}: give the output_dir of a `gym train` run")
        try:
            config = json.loads((path / "run_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        checkpoints = [row.get("name", "?") for row in read_jsonl(path / "checkpoints.jsonl")]
        return cls(path, read_jsonl(path / "metrics.jsonl"), config, checkpoints)

    def series(self, name: str) -> tuple[list[int], list[float]]:
        points = [
            (row["step"], row[name])
            for row in self.rows
            if isinstance(row.get(name), int | float) and isinstance(row.get("step"), int)
        ]
        return [step for step, _ in points], [float(value) for _, value in points]

    @property
    def kind(self) -> str:
        method = self.config.get("rl") or "sft"
        adapter = self.config.get("adapter") or "full fine-tuning"
        return f"{str(method).upper()} ({adapter})"

    @property
    def state(self) -> str:
        if any((self.path / name).is_file() for name in FINAL_OUTPUTS):
            return "finished"
        if self.checkpoints:
            return f"stopped; {self.checkpoints[-1]} continues it"
        return "running or stopped before its first checkpoint"


def summary(run: RunRecord) -> list[str]:
    """A few lines: what the run is, how far it got, and where each headline metric went."""
    steps = [row["step"] for row in run.rows if isinstance(row.get("step"), int)]
    elapsed = max((row.get("elapsed_s", 0) for row in run.rows), default=0)
    lines = [f"{run.path}: {run.kind}, {run.state} · {max(steps, default=0)} steps · {duration(elapsed)}"]
    for name in ("loss", "eval/loss", "reward", "eval/reward", "rewards/margins", "rewards/accuracies"):
        at, values = run.series(name)
        if not values:
            continue
        line = f"  {name} {_number(values[0])} → {_number(values[-1])} (step {at[0]} → {at[-1]})"
        if name.startswith("eval/") and len(values) > 2:
            best = (min if name.endswith("loss") else max)(range(len(values)), key=values.__getitem__)
            line += f", best {_number(values[best])} at step {at[best]}"
        lines.append(line)
    details = []
    _, rates = run.series("lr")
    if rates:
        details.append(f"lr peak {max(rates):.2e}, last {rates[-1]:.2e}")
    _, norms = run.series("grad_norm")
    if norms:
        details.append(f"grad_norm last {_number(norms[-1])}")
    _, speeds = run.series("tokens_per_s")
    if speeds:
        details.append(f"tokens/s median {statistics.median(speeds):.0f}")
    if details:
        lines.append("  " + " · ".join(details))
    if run.checkpoints:
        lines.append(f"  checkpoints: {', '.join(run.checkpoints)}")
    return lines


def chart_names(runs: list[RunRecord]) -> list[tuple[str, tuple[str, ...]]]:
    """The charts the runs have data for: CHARTS first, then each other numeric eval/ metric."""
    logged = {
        name for run in runs for row in run.rows for name, v in row.items() if isinstance(v, int | float)
    }
    charts = [(title, names) for title, names in CHARTS if logged & set(names)]
    drawn = {name for _, names in charts for name in names}
    charts += [(name, (name,)) for name in sorted(logged - drawn) if name.startswith("eval/")]
    return charts[:MOST_CHARTS]


def draw(runs: list[RunRecord], out: Path) -> None:
    """One PNG: a chart per metric, every run on each, training lines solid and eval lines dashed."""
    try:
        import matplotlib
    except ImportError:
        raise GymError(
            "gym report draws with matplotlib, which is not installed: pip install 'hanzo-gym[report]' "
            "(the summary above needs nothing)"
        ) from None
    matplotlib.use("Agg")  # a file, never a window: this runs on servers
    from matplotlib import pyplot

    charts = chart_names(runs)
    if not charts:
        raise GymError(f"{', '.join(str(r.path) for r in runs)}: metrics.jsonl holds no numbers to draw yet")
    columns = min(3, len(charts))
    rows = math.ceil(len(charts) / columns)
    figure, axes = pyplot.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    labels = _labels(runs)
    colours = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    for chart, (title, names) in zip(axes.flat, charts):
        for index, run in enumerate(runs):
            for name in names:
                at, values = run.series(name)
                if not values:
                    continue
                evaluation = name.startswith("eval/") and len(names) > 1
                chart.plot(
                    at,
                    values,
                    color=colours[index % len(colours)],
                    linestyle="--" if evaluation else "-",
                    marker="o" if evaluation or len(values) == 1 else None,
                    markersize=3,
                    label=_legend(labels[index], name, len(runs), len(names)),
                )
        chart.set_title(title)
        chart.set_xlabel("step")
        chart.grid(alpha=0.3)
        if title == "learning rate":
            chart.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        if chart.get_legend_handles_labels()[0]:
            chart.legend(fontsize="small")
    for unused in list(axes.flat)[len(charts) :]:
        unused.set_visible(False)
    figure.suptitle(" vs ".join(labels))
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    figure.savefig(partial, format="png", dpi=100)
    pyplot.close(figure)
    partial.replace(out)  # a picture is whole or absent, as every file a run writes


def report(run_dirs: list[str], out: str | None = None) -> Path:
    runs = [RunRecord.read(path) for path in run_dirs]
    for run in runs:
        print("\n".join(summary(run)))
    destination = (
        Path(out) if out else (runs[0].path / "report.png" if len(runs) == 1 else Path("report.png"))
    )
    draw(runs, destination)
    print(f"wrote {destination}")
    return destination


def _labels(runs: list[RunRecord]) -> list[str]:
    names = [run.path.name or str(run.path) for run in runs]
    return names if len(set(names)) == len(names) else [str(run.path) for run in runs]


def _legend(run: str, metric: str, runs: int, metrics: int) -> str | None:
    """Which run and which metric a line is, where a chart holds more than one line."""
    if runs > 1:
        return f"{run} {metric}"
    return metric if metrics > 1 else None


def _number(value: float) -> str:
    return f"{value:.4g}"
