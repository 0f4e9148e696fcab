"""`entropylens demo`: train the toy policy under several methods, record each run, write the report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .toy.config import DEMO_DEFAULT, config_for

# --quick: a few small steps per run, for tests and a first look (finishes in well under 30 s).
QUICK = dict(steps=6, prompts=8, group=4, minibatches=2, epochs=2, sft_steps=40)


@dataclass
class DemoResult:
    runs_dir: Path
    report_dir: Path | None
    runs: list  # RunResult


def run_demo(
    out: str | Path = "entropylens-demo",
    *,
    methods: tuple[str, ...] = DEMO_DEFAULT,
    steps: int | None = None,
    seeds: int = 1,
    quick: bool = False,
    report: bool = True,
    progress: bool = True,
    console=None,
) -> DemoResult:
    """Train every (method, seed), record under ``out/runs/<method>-s<seed>``, report to ``out/report``.
    Configs are validated for all runs before any training starts."""
    import torch

    from .toy.train import train

    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    overrides = dict(QUICK) if quick else {}
    if steps is not None:
        overrides["steps"] = steps
    cfgs = [config_for(m, seed=s, **overrides) for m in methods for s in range(seeds)]  # fail early
    out = Path(out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    results = []
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cols = (TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]:.3f}  entropy {task.fields[entropy]:.3f}"),
                TimeElapsedColumn())
        with Progress(*cols, console=console) as bar:
            for cfg in cfgs:
                name = f"{cfg.name}-s{cfg.seed}"
                task_id = bar.add_task(name, total=cfg.steps, reward=0.0, entropy=float("nan"))

                def on_step(step, r, h, _t=task_id):
                    bar.update(_t, completed=step + 1, reward=r, entropy=h)

                results.append(train(cfg, runs_dir, run=name, on_step=on_step))
    else:
        results = [train(cfg, runs_dir, run=f"{cfg.name}-s{cfg.seed}") for cfg in cfgs]
    report_dir = None
    if report:
        from .report import write_report

        report_dir = out / "report"
        write_report(runs_dir, report_dir, runs=[r.run for r in results])
    return DemoResult(runs_dir, report_dir, results)
