"""What `gym synth` shows a person: a progress bar on a terminal, preview rows as JSON, the final summary."""

from __future__ import annotations

import sys

from hanzo_gym.errors import ConfigError
from hanzo_gym.synth.run import SynthShortfall, Tally, synthesize
from hanzo_gym.synth.values import row_json


class _ProgressBar:
    """A tqdm bar over rows delivered, with drops and failures alongside; silent when stderr is not a terminal."""

    def __init__(self) -> None:
        self._bar = None

    def __call__(self, delivered: int, requested: int, tally: Tally) -> None:
        if not sys.stderr.isatty():
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=requested, initial=delivered, unit="row", desc="synth", file=sys.stderr)
        self._bar.n = delivered
        self._bar.set_postfix(
            dropped=sum(tally.dropped.values()), failed=sum(tally.failed.values()), refresh=False
        )
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_synth_command(design_path: str, preview: int | None = None) -> None:
    if preview is not None and preview < 1:
        raise ConfigError("--preview needs a row count of at least 1")
    bar = _ProgressBar()
    try:
        report = synthesize(design_path, preview=preview, progress=bar)
    finally:
        bar.close()
    if preview is not None:
        for row in report.rows:
            print(row_json(row, indent=2))
        print(report.format(), file=sys.stderr)
    else:
        print(report.format())
    if report.shortfall:
        raise SynthShortfall(report.shortfall)
