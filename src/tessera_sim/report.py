"""Render a study: a JSON document, CSV tables and PNG plots in an output directory."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tessera_sim.analysis import Study
from tessera_sim.pauses import ScaledPauses


def to_dict(study: Study) -> dict[str, Any]:
    """The whole study as JSON-ready data (the first trace as a time series)."""
    doc: dict[str, Any] = {
        "config": asdict(study.config),
        "policies": study.policies,
        "trace_stats": study.trace_stats,
        "goodput": study.goodput,
        "loss_vs_failed_fraction": study.loss,
        "availability_vs_tp": study.availability,
    }
    if study.trace is not None:
        doc["trace"] = trace_rows(study)
    if study.pauses is not None:
        doc["measured_pauses"] = measured_pauses(study.pauses, study.measured_goodput)
    return doc


def measured_pauses(pauses: ScaledPauses, goodput: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench's job, the scale factors, each measured fault scaled, and goodput both ways."""
    return {
        "bench_job": asdict(pauses.job),
        "factors": asdict(pauses.factors),
        "faults": {
            name: [{**asdict(row.fault), "scaled_pause_s": row.scaled_s} for row in p.faults]
            for name, p in pauses.policies.items()
        },
        "goodput": goodput,
    }


def share_label(rows: list[dict[str, Any]]) -> str:
    """The failed share the rows actually had (whole blocks), e.g. '0.101% failed'."""
    shares = sorted({r["failed_fraction"] for r in rows})
    low, high = (f"{100 * x:.3g}%" for x in (shares[0], shares[-1]))
    return f"{low} failed" if low == high else f"{low}-{high} failed"


def trace_rows(study: Study) -> list[dict[str, Any]]:
    trace = study.trace
    if trace is None:
        return []
    return [
        {
            "day": float(trace.start[i]),
            "failed_fraction": float(trace.failed_fraction[i]),
            **{name: float(trace.throughput[i, j]) for j, name in enumerate(trace.policies)},
        }
        for i in range(len(trace.start))
    ]


def write_json(study: Study, path: Path) -> None:
    path.write_text(json.dumps(to_dict(study), indent=2) + "\n")


def write_csvs(study: Study, out: Path) -> list[Path]:
    tables = {
        "goodput.csv": study.goodput,
        "loss_vs_failed_fraction.csv": study.loss,
        "availability_vs_tp.csv": study.availability,
        "trace.csv": trace_rows(study),
        "goodput_measured_pauses.csv": study.measured_goodput,
    }
    written = []
    for name, rows in tables.items():
        if not rows:
            continue
        path = out / name
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        written.append(path)
    return written


def write_plots(study: Study, out: Path) -> list[Path]:
    """Four PNGs; matplotlib is imported here, with the Agg backend, so the core never needs it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = [p["policy"] for p in study.policies]
    # Some policies coincide (same capacity, different pauses): dashes keep both visible.
    dashes = {name: "--" if i % 2 else "-" for i, name in enumerate(names)}
    written = []

    def finish(fig: Any, ax: Any, name: str, **labels: str) -> None:
        ax.set(**labels)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)

    def by_policy(key: str, scale: float, err: str | None = None) -> tuple[Any, Any]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in names:
            rows = [r for r in study.loss if r["policy"] == name]
            ax.errorbar(
                [100 * r["failed_fraction"] for r in rows],
                [scale * r[key] for r in rows],
                yerr=[scale * r[err] for r in rows] if err else None,
                marker="o",
                markersize=3,
                capsize=2,
                linestyle=dashes[name],
                label=name,
            )
        return fig, ax

    # 1. Throughput loss, and 2. spares for a fixed mini-batch, vs share of failed GPUs.
    fig, ax = by_policy("loss_mean", 100, err="loss_std")
    finish(
        fig,
        ax,
        "loss_vs_failed_fraction.png",
        xlabel="failed GPUs (%)",
        ylabel="throughput loss (%)",
        title="Loss vs failed fraction",
    )
    fig, ax = by_policy("spares_mean", 1)
    finish(
        fig,
        ax,
        "spares_vs_failed_fraction.png",
        xlabel="failed GPUs (%)",
        ylabel="standby domains needed",
        title="Spares to keep a fixed mini-batch",
    )

    # 3. Availability vs TP size, Monte Carlo against the closed form.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fraction in sorted({r["requested_fraction"] for r in study.availability}):
        rows = [r for r in study.availability if r["requested_fraction"] == fraction]
        tps = [r["tp"] for r in rows]
        line = ax.plot(
            tps,
            [100 * r["intact_share"] for r in rows],
            marker="o",
            label=share_label(rows),
        )
        ax.plot(
            tps, [100 * r["closed_form"] for r in rows], linestyle="--", color=line[0].get_color()
        )
    finish(
        fig,
        ax,
        "availability_vs_tp.png",
        xlabel="TP size (GPUs)",
        ylabel="GPUs in intact TP groups (%)",
        title="Availability vs TP size (dashed: (1-f)^TP)",
    )

    # 4. Throughput over the first trace.
    if study.trace is not None:
        trace = study.trace
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for j, name in enumerate(trace.policies):
            ax.step(
                trace.start,
                100 * trace.throughput[:, j],
                where="post",
                label=name,
                linestyle=dashes[name],
            )
        twin = ax.twinx()
        twin.step(trace.start, 100 * trace.failed_fraction, where="post", color="grey", alpha=0.4)
        twin.set_ylabel("failed GPUs (%, grey)")
        finish(
            fig,
            ax,
            "trace.png",
            xlabel="day",
            ylabel="throughput (% of healthy)",
            title="Throughput over a trace",
        )
    return written


def write_all(study: Study, out: Path, plots: bool = True) -> list[Path]:
    """JSON, CSVs and (unless `plots` is False) PNGs into `out`, created if missing."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(study, out / "study.json")
    written = [out / "study.json", *write_csvs(study, out)]
    if plots:
        written += write_plots(study, out)
    return written
