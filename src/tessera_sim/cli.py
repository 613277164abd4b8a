"""`tessera-dev simulate`: compare recovery policies for a large job under GPU failures."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tessera_contracts.model_shape import ModelShape, PlanError
from tessera_sim import pauses, report
from tessera_sim.analysis import (
    DEFAULT_FRACTIONS,
    DEFAULT_TPS,
    MAX_EVALUATIONS,
    MAX_POINTS,
    MAX_UPDATES,
    Study,
    StudySettings,
    run_study,
)
from tessera_sim.config import (
    MAX_DAYS,
    MAX_DP,
    MAX_EXACT_INT,
    MAX_GPUS,
    MAX_HEADROOM,
    MAX_MODEL,
    MAX_PP,
    MAX_TP,
    ConfigError,
    FailureConfig,
    ModelConfig,
    PolicyConfig,
    SimConfig,
)

# Config field -> the flag that sets it, so an error says what to change.
_FLAGS = {
    "gpus": "--gpus, --tp, --pp or --dp",
    "domain_size": "--domain-size",
    "tp": "--tp",
    "pp": "--pp",
    "dp": "--dp",
    "days": "--days",
    "seed": "--seed",
    "model": "--hidden, --heads, --kv-heads, --ffn, --vocab, --layers or --seq-len",
    "model.hidden": "--hidden",
    "model.n_heads": "--heads",
    "model.n_kv_heads": "--kv-heads",
    "model.ffn": "--ffn",
    "model.vocab": "--vocab",
    "model.n_layers": "--layers",
    "model.seq_len": "--seq-len",
    "model.tokens_per_batch": "--tokens-per-batch",
    "failures.rate_per_gpu_day": "--rate",
    "failures.hardware_share": "--hardware-share",
    "failures.hardware_repair_days": "--hardware-repair-days",
    "failures.software_repair_hours": "--software-repair-hours",
    "failures.blast_radius": "--blast-radius",
    "policy.power_headroom": "--headroom",
    "policy.min_tp": "--min-tp",
    "policy.spare_domains": "--spare-domains",
    "policy.restart_minutes": "--restart-minutes",
    "policy.checkpoint_interval_minutes": "--checkpoint-minutes",
    "policy.reconfigure_seconds": "--reconfigure-seconds",
    "policy.spare_swap_seconds": "--spare-swap-seconds",
    "traces": "--traces",
    "trials": "--trials",
    "fractions": "--fractions",
    "tps": "--tps",
    "replay": "--rate, --days, --traces, --gpus, --spare-domains, --blast-radius or the repair "
    "times",
    "snapshots": "--trials, --fractions, --tps or --gpus",
}

_BOUNDS = (
    f"Bounds: the NTPTrainingJob schema's job and model sizes (at most {MAX_GPUS:,} GPUs with the "
    f"spare domains, TP {MAX_TP}, PP {MAX_PP}, DP {MAX_DP:,}); durations up to {MAX_DAYS:,g} days "
    f"(the float64 day clock stays exact to 1 us); seed and batch up to 2^53 (exact in JSON); "
    f"--headroom up to {MAX_HEADROOM:.3f} (the power model's peak); at most {MAX_POINTS} "
    f"--fractions and --tps. A study replays at most {MAX_EVALUATIONS:,} failure and repair "
    f"events over all its traces and draws as many snapshots, each evaluating every policy over "
    f"every TP group, with at most {MAX_UPDATES:,} group updates each: a few minutes and under "
    f"1 GB. Every bound is checked before anything is written."
)

# Failed fractions shown in the loss table (every fraction goes to the CSV/JSON and plots).
_TABLE_FRACTIONS = (0.001, 0.002, 0.004, 0.01)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def build_parser() -> argparse.ArgumentParser:
    d, m, f, p = SimConfig(), ModelConfig(), FailureConfig(), PolicyConfig()
    parser = argparse.ArgumentParser(
        prog="tessera-dev simulate",
        description="Simulate a large training job under GPU failures and compare checkpoint-"
        "restart, DP-DROP (packed and unpacked), hot spares, NTP, NTP-PW and Tessera on the same "
        "failure traces.",
        epilog=_BOUNDS,
    )
    parser.add_argument("--out", type=Path, default=Path("sim-out"), help="output directory")
    parser.add_argument("--json", action="store_true", help="print the study as JSON on stdout")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--days", type=float, default=d.days, help=f"trace length in days, at most {MAX_DAYS:,g}"
    )
    parser.add_argument(
        "--seed", type=int, default=d.seed, help="seed for every random draw, 0 to 2^53"
    )
    job = parser.add_argument_group("job")
    job.add_argument(
        "--gpus",
        type=int,
        help=f"job GPUs (default tp x pp x dp = {d.gpus}); with the spares at most {MAX_GPUS:,}",
    )
    job.add_argument("--domain-size", type=int, default=d.domain_size, help="scale-up domain")
    job.add_argument("--tp", type=int, default=d.tp, help=f"healthy TP degree, at most {MAX_TP}")
    job.add_argument("--pp", type=int, default=d.pp, help=f"pipeline stages, at most {MAX_PP}")
    job.add_argument(
        "--dp",
        type=int,
        help=f"DP replicas (default gpus / (tp x pp) = {d.dp}), at most {MAX_DP:,}",
    )
    model = parser.add_argument_group("model (default: the paper's 480B model)")
    for flag, name in (
        ("--hidden", "hidden"),
        ("--heads", "n_heads"),
        ("--kv-heads", "n_kv_heads"),
        ("--ffn", "ffn"),
        ("--vocab", "vocab"),
        ("--layers", "n_layers"),
        ("--seq-len", "seq_len"),
    ):
        model.add_argument(
            flag,
            type=int,
            dest=name,
            default=getattr(m.shape, name),
            help=f"at most {MAX_MODEL[name]:,}",
        )
    model.add_argument(
        "--tokens-per-batch",
        type=int,
        default=m.tokens_per_batch,
        help=f"global batch in tokens: a whole number of sequences per DP replica, at most "
        f"{MAX_EXACT_INT:,}",
    )
    fail = parser.add_argument_group("failures")
    fail.add_argument(
        "--rate",
        type=float,
        default=f.rate_per_gpu_day,
        help=f"failures per GPU per day (bounded by the {MAX_EVALUATIONS:,} replayed events)",
    )
    fail.add_argument("--hardware-share", type=float, default=f.hardware_share)
    fail.add_argument("--hardware-repair-days", type=float, default=f.hardware_repair_days)
    fail.add_argument("--software-repair-hours", type=float, default=f.software_repair_hours)
    fail.add_argument(
        "--repair-distribution", choices=("fixed", "exponential"), default=f.repair_distribution
    )
    fail.add_argument(
        "--blast-radius",
        type=int,
        default=f.blast_radius,
        help="GPUs one failure takes out (1 GPU, 2 superchip, 4/8 node, domain); the per-GPU "
        "rate stays --rate, so failures are --blast-radius times rarer",
    )
    pol = parser.add_argument_group("policies")
    pol.add_argument(
        "--headroom",
        type=float,
        default=p.power_headroom,
        help=f"extra power for survivors, as a share of the baseline cap, at most "
        f"{MAX_HEADROOM:.3f}",
    )
    pol.add_argument(
        "--min-tp", type=int, default=p.min_tp, help="smallest usable TP degree (0: tp / 2)"
    )
    pol.add_argument(
        "--spare-domains",
        type=int,
        default=p.spare_domains,
        help=f"hot standby domains of the spares policy; with the job at most {MAX_GPUS:,} GPUs",
    )
    pol.add_argument(
        "--stage-aware-regroup",
        action="store_true",
        help="regrouped replicas take one group of each pipeline stage (default: a group may "
        "serve any stage, reloading its weights while the job reconfigures)",
    )
    pol.add_argument("--restart-minutes", type=float, default=p.restart_minutes)
    pol.add_argument("--checkpoint-minutes", type=float, default=p.checkpoint_interval_minutes)
    pol.add_argument("--reconfigure-seconds", type=float, default=p.reconfigure_seconds)
    pol.add_argument("--spare-swap-seconds", type=float, default=p.spare_swap_seconds)
    pol.add_argument(
        "--pauses",
        type=Path,
        metavar="FILE",
        help=f"pauses measured by a recovery bench ({pauses.FORMAT}): scaled to this job and "
        "charged to the policies it lists; goodput is reported with both the assumed and these",
    )
    mc = parser.add_argument_group("Monte Carlo")
    s = StudySettings()
    mc.add_argument("--traces", type=int, default=s.traces, help="failure traces to replay, >= 1")
    mc.add_argument("--trials", type=int, default=s.trials, help="draws per failed fraction, >= 1")
    mc.add_argument(
        "--fractions",
        type=_floats,
        default=DEFAULT_FRACTIONS,
        help=f"failed fractions for the loss curve, comma-separated, each in [0, 1), at most "
        f"{MAX_POINTS}",
    )
    mc.add_argument(
        "--tps",
        type=_ints,
        default=DEFAULT_TPS,
        help=f"TP sizes for the availability curve, comma-separated, at most {MAX_POINTS}",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """A validated config; gpus and dp default to each other through tp x pp."""
    try:
        shape = ModelShape(**{f.name: getattr(args, f.name) for f in fields(ModelShape)
                              if hasattr(args, f.name)})
    except PlanError as exc:
        raise ConfigError("model", f"model shape: {exc}") from exc
    group = args.tp * args.pp
    if args.dp is None and args.gpus is not None and group > 0 and args.gpus % group:
        raise ConfigError(
            "gpus",
            f"gpus {args.gpus} is not a multiple of tp x pp = {args.tp} x {args.pp} = {group}",
        )
    dp = args.dp if args.dp is not None else (args.gpus or SimConfig.gpus) // max(group, 1)
    gpus = args.gpus if args.gpus is not None else group * dp
    cfg = SimConfig(
        gpus=gpus,
        domain_size=args.domain_size,
        tp=args.tp,
        pp=args.pp,
        dp=dp,
        model=ModelConfig(shape, args.tokens_per_batch),
        failures=FailureConfig(
            rate_per_gpu_day=args.rate,
            hardware_share=args.hardware_share,
            hardware_repair_days=args.hardware_repair_days,
            software_repair_hours=args.software_repair_hours,
            repair_distribution=args.repair_distribution,
            blast_radius=args.blast_radius,
        ),
        policy=PolicyConfig(
            power_headroom=args.headroom,
            min_tp=args.min_tp,
            spare_domains=args.spare_domains,
            restart_minutes=args.restart_minutes,
            checkpoint_interval_minutes=args.checkpoint_minutes,
            reconfigure_seconds=args.reconfigure_seconds,
            spare_swap_seconds=args.spare_swap_seconds,
            stage_aware_regroup=args.stage_aware_regroup,
        ),
        days=args.days,
        seed=args.seed,
    )
    return cfg.validate()


def load_pauses(path: Path, cfg: SimConfig) -> pauses.ScaledPauses:
    """The pauses file scaled to `cfg`'s job; ValueError naming the file and the JSON path."""
    try:
        return pauses.scale(pauses.parse(pauses.decode(path.read_text())), cfg)
    except OSError as exc:
        raise ValueError(f"--pauses {path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"--pauses {path}: not UTF-8 text: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--pauses {path}: not JSON: {exc}") from exc
    except pauses.PausesError as exc:
        raise ValueError(f"--pauses {path}: {exc}") from exc


def _pct(x: float, digits: int = 2) -> str:
    return f"{100 * x:.{digits}f}%"


def render_tables(study: Study, console: Console) -> None:
    cfg = study.config
    stats = study.trace_stats
    console.print(
        f"[bold]{cfg.gpus:,} GPUs[/] in {cfg.domain_size}-GPU domains, TP{cfg.tp} x PP{cfg.pp} x "
        f"DP{cfg.dp} ({cfg.sequences_per_replica} sequences of {cfg.model.shape.seq_len:,} "
        f"tokens per replica), {cfg.days:g}-day traces: "
        f"{stats['failures_per_day']:.1f} failures/day, "
        f"{_pct(stats['failed_fraction_mean'])} GPUs failed on average "
        f"(peak {_pct(stats['failed_fraction_peak'])}), >0.1% failed "
        f"{_pct(stats['time_above_0.1pct'])} of the time"
    )
    table = Table(
        title="Over the failure traces (throughput: mean, worst)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    cols = ("policy", "goodput", "mean", "worst", "paused", "spares*", "+power", "peak")
    for col in cols:
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in study.goodput:
        table.add_row(
            r["policy"],
            *(_pct(r[k], 1) for k in ("goodput_mean", "throughput_mean", "throughput_min")),
            _pct(r["stall_share"], 1),
            str(r["spares_needed_max"]),
            _pct(r["extra_power_mean"]),
            _pct(r["peak_group_power"], 1),
        )
    console.print(table)
    console.print(
        "* standby domains to keep the full mini-batch at the worst moment (for `spares`: beyond "
        "its own pool); +power: mean draw above the baseline caps; peak: the hungriest TP group "
        "against its healthy budget"
    )
    if study.pauses is not None:
        render_measured(study.pauses, study.measured_goodput, console)
    shown = [x for x in _TABLE_FRACTIONS if any(r["requested_fraction"] == x for r in study.loss)]
    table = Table(title="Throughput loss (spares for a fixed mini-batch) at a failed share")
    table.add_column("policy")
    for x in shown:
        rows = [r for r in study.loss if r["requested_fraction"] == x]
        label = f"{report.share_label(rows)} ({rows[0]['failed_gpus']} GPUs)"
        table.add_column(label, justify="right")
    for p in study.policies:
        cells = {r["requested_fraction"]: r for r in study.loss if r["policy"] == p["policy"]}
        table.add_row(
            p["policy"],
            *(f"{_pct(cells[x]['loss_mean'])} ({cells[x]['spares_mean']:.0f})" for x in shown),
        )
    console.print(table)
    table = Table(title="GPUs in intact TP groups (closed form (1-f)^TP)")
    table.add_column("TP", justify="right")
    fractions = sorted({r["requested_fraction"] for r in study.availability})
    for x in fractions:
        rows = [r for r in study.availability if r["requested_fraction"] == x]
        table.add_column(report.share_label(rows), justify="right")
    for tp in sorted({r["tp"] for r in study.availability}):
        cells = {r["requested_fraction"]: r for r in study.availability if r["tp"] == tp}
        table.add_row(
            str(tp),
            *(
                f"{_pct(cells[x]['intact_share'])} ({_pct(cells[x]['closed_form'])})"
                for x in fractions
            ),
        )
    console.print(table)


def render_measured(
    scaled: pauses.ScaledPauses, rows: list[dict[str, Any]], console: Console
) -> None:
    job, f = scaled.job, scaled.factors
    m = f.model
    table = Table(
        title=f"Goodput with the measured pauses (--pauses: a {job.gpus}-GPU, {job.nodes}-node "
        f"bench of {job.parameters:,} parameters; rest scaled x{f.restart:.3g} for "
        f"{f.sim_nodes:,} nodes against {f.bench_nodes}; {f.shard_bytes / pauses.GB:.3g} GB "
        f"per GPU moved at {m.storage_gbps:g} GB/s from storage, {m.scale_out_gbps:g} GB/s "
        f"scale-out)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    cols = ("policy", "pauses", "failure s", "repair s", "goodput", "measured")
    for col in cols:
        table.add_column(col, justify="left" if col in cols[:2] else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r["policy"],
            r["pauses"],
            *(
                f"{r[k + '_assumed']:,.0f} -> {r[k]:,.0f}"
                for k in ("failure_stall_s", "repair_stall_s")
            ),
            _pct(r["goodput_mean_assumed"], 1),
            _pct(r["goodput_mean_measured"], 1),
        )
    console.print(table)
    console.print(
        "pauses: assumed -> charged (a restart's includes half the checkpoint interval); "
        "goodput: with the assumed pauses, then with the measured ones"
    )


def input_error(prog: str, exc: ValueError, flags: dict[str, str] | None = None) -> int:
    """Print one line naming the flag to change (for a ConfigError, from `flags`, by default
    `tessera-dev simulate`'s); the exit status to use."""
    flag = (flags or _FLAGS).get(exc.field) if isinstance(exc, ConfigError) else None
    hint = f" (change {flag})" if flag else ""
    Console(stderr=True).print(
        f"[red]{prog}: error:[/] {escape(str(exc))}{hint}", highlight=False, soft_wrap=True
    )
    return 2


def prepare_out(out: Path) -> None:
    """Create `out` now, so an unusable path fails before the study runs, not after."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create --out {out}: {exc.strerror}") from exc
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    err = Console(stderr=True)
    try:
        cfg = config_from_args(args)
        settings = StudySettings(
            fractions=args.fractions, tps=args.tps, trials=args.trials, traces=args.traces
        ).validate(cfg)
        scaled = None if args.pauses is None else load_pauses(args.pauses, cfg)
        prepare_out(args.out)
    except ValueError as exc:
        return input_error("tessera-dev simulate", exc)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)

        study = run_study(cfg, settings, progress, scaled)
    written = report.write_all(study, args.out, plots=not args.no_plots)
    if args.json:
        print(json.dumps(report.to_dict(study), indent=2))
    else:
        console = Console()
        render_tables(study, console)
        console.print(f"wrote {len(written)} files to {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
