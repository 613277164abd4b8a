"""The demo's figure: goodput, TP degree per replica, power per GPU and the loss over the demo's
time, from Prometheus range queries, with the faults marked. The series go beside the PNG as
JSON, so the figure's numbers can be read without it."""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the PNG is the output

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

Series = dict[str, list[tuple[float, float]]]  # legend label -> (unix time, value) points


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    promql: str
    label: str  # how a series is named from its labels, e.g. "{node} GPU {gpu}"


def panels(job: str) -> tuple[Panel, ...]:
    return (
        Panel("goodput (trainer, per node)", "productive / wall",
              f'tessera_goodput_ratio{{ntpjob="{job}"}}', "{node}"),
        Panel("tensor-parallel degree per replica", "TP",
              f'max by (replica) (tessera_replica_tp_degree{{ntpjob="{job}"}})',
              "replica {replica}"),
        Panel("GPU power limit (power agents)", "W", "tessera_gpu_power_limit_watts",
              "{node} GPU {gpu}"),
        Panel("loss of the last step (trainer, per node)", "cross-entropy",
              f'tessera_loss{{ntpjob="{job}"}}', "{node}"),
    )


def query_range(url: str, promql: str, start: float, end: float, step: float) -> Series:
    """A range query's series, each named by its labels (sorted); ValueError if it failed."""
    params = urllib.parse.urlencode({"query": promql, "start": f"{start:.3f}",
                                     "end": f"{end:.3f}", "step": f"{step:g}"})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise ValueError(f"range query {promql!r} failed: {body.get('error')}")
    return {json.dumps(item["metric"], sort_keys=True):
            [(float(t), float(v)) for t, v in item["values"]] for item in body["data"]["result"]}


def _name(labels_json: str, template: str) -> str:
    labels = json.loads(labels_json)
    try:
        return template.format(**labels)
    except KeyError:
        return labels_json


def collect(url: str, job: str, start: float, end: float, step: float = 1.0
            ) -> dict[str, Series]:
    """Panel title -> its series over [start, end], `end` one of the points (the state the
    demo ended on)."""
    first = end - math.ceil((end - start) / step) * step
    return {p.title: {_name(k, p.label): v for k, v in sorted(
        query_range(url, p.promql, first, end, step).items())} for p in panels(job)}


def draw(data: dict[str, Series], job: str, events: Sequence[tuple[float, str]], start: float,
         out: Path) -> None:
    """Write the PNG to `out` and the series to `out` with suffix .json. `events` are
    (unix time, label) marks drawn on every panel; time runs in seconds from `start`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(len(panels(job)), 1, figsize=(13, 13), sharex=True)
    for ax, panel in zip(axes, panels(job), strict=True):
        for name, points in data[panel.title].items():
            ax.step([t - start for t, _ in points], [v for _, v in points], where="post",
                    label=name)
        for k, (at, label) in enumerate(events):
            ax.axvline(at - start, color="grey", linestyle="--", linewidth=1)
            # one line each: faults a few seconds apart would overprint
            ax.annotate(label, (at - start, 1), xycoords=("data", "axes fraction"),
                        xytext=(3, -12 * (k + 1)), textcoords="offset points", fontsize=8)
        ax.set_title(panel.title, loc="left")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    axes[-1].set_xlabel("seconds since the job was applied")
    figure.suptitle(f"tessera-dev demo: {job}")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    out.with_suffix(".json").write_text(json.dumps(
        {"start": start, "events": [{"time": t, "label": label} for t, label in events],
         "panels": data}, indent=1))
