"""Typed simulation config (job, model, failure process, policy knobs) with one validation step.

Defaults reproduce the NTP paper's simulated setup (32,768 GPUs in NVL32 domains, TP32 x PP8 x
DP128, a 480B model, a 15-day trace) and the Llama 3 failure statistics (DESIGN.md section 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from tessera_contracts.jobspec import min_tensor_parallel
from tessera_core import plan
from tessera_core.perf_model import PAPER

RepairDistribution = Literal["fixed", "exponential"]

# Job and model bounds are the NTPTrainingJob schema's
# (crds/ntptrainingjob.yaml; a test keeps them equal): the simulator covers
# every job the operator accepts, and no larger one.
MAX_GPUS = 1_048_576  # totalGPUs: the job and its spare domains together
MAX_TP = 576
MAX_PP = 1024
MAX_DP = 65_536
MAX_MODEL = {
    "hidden": 262_144,
    "n_heads": 4096,
    "n_kv_heads": 4096,
    "ffn": 1_048_576,
    "vocab": 4_194_304,
    "n_layers": 4096,
    "seq_len": 16_777_216,
}
# The clock is a float64 day count: at day D it resolves D x 2^-52 days, so up to 50,000 days
# (137 years) every instant is exact to 1 us (50,000 x 86,400 s x 2^-52 = 1e-6 s), and the
# seconds-long pauses keep their length. Every duration (trace, repairs, pauses) is bounded by it.
MAX_DAYS = 50_000.0
# Integers a JSON reader holds exactly (IEEE doubles): the seed and the batch appear in study.json.
MAX_EXACT_INT = 2**53
# Past this power ratio the perf model's speed falls again (+40%): more headroom buys nothing.
MAX_HEADROOM = PAPER.max_ratio() - 1.0


class ConfigError(ValueError):
    """A simulation config that cannot describe a real job; `field` names the offending one."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# The paper's GPT-style 480B model: multi-head attention, SwiGLU width 2.5 x hidden, so
# (4 h^2 + 3 h ffn) x 100 layers + embeddings = 487B parameters.
PAPER_MODEL = plan.ModelShape(
    hidden=20_480,
    n_heads=128,
    n_kv_heads=128,
    ffn=51_200,
    vocab=128_256,
    n_layers=100,
    seq_len=16_384,
)


@dataclass(frozen=True)
class ModelConfig:
    """The trained model (the planner balances per-rank work from its shape) and its batch."""

    shape: plan.ModelShape = PAPER_MODEL
    tokens_per_batch: int = 16 * 1024 * 1024


@dataclass(frozen=True)
class FailureConfig:
    """Failure process: Poisson arrivals per GPU, a hardware/software mix, repair times."""

    # Llama 3: 419 interruptions on 16,384 GPUs in 54 days -> 4.7e-4 per GPU per day.
    rate_per_gpu_day: float = 4.7e-4
    # Llama 3 attributes about 78% of unexpected interruptions to (suspected) hardware.
    hardware_share: float = 0.78
    hardware_repair_days: float = 3.0
    software_repair_hours: float = 3.0
    repair_distribution: RepairDistribution = "fixed"
    # GPUs taken out by one failure, aligned inside a domain: 1 = the GPU only, 2 = a GB200
    # superchip, 4 or 8 = a node, domain_size = the whole scale-up domain.
    blast_radius: int = 1


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the recovery policies; times not given by the paper are stated assumptions."""

    # Survivors of a hit domain may draw up to this much above their baseline cap (paper: +30%).
    power_headroom: float = 0.30
    # Below this many survivors a TP group cannot hold its shard (memory); it is dropped.
    # 0 means tp // 2.
    min_tp: int = 0
    # Hot standby scale-up domains for the `spares` policy (extra hardware beyond the job).
    spare_domains: int = 32
    # Regrouped replicas take exactly one group per pipeline stage (a group keeps the stage whose
    # weights it holds). Off, a group may serve any stage: it reloads that stage's weights from a
    # healthy replica of it during the reconfiguration pause.
    stage_aware_regroup: bool = False
    restart_minutes: float = 10.0
    checkpoint_interval_minutes: float = 30.0
    reconfigure_seconds: float = 60.0
    spare_swap_seconds: float = 120.0

    @property
    def lost_work_s(self) -> float:
        """The work a restart redoes on average: half a checkpoint interval."""
        return 60 * self.checkpoint_interval_minutes / 2


@dataclass(frozen=True)
class SimConfig:
    """One simulated job: topology, model, failure process, policies and trace length."""

    gpus: int = 32_768
    domain_size: int = 32
    tp: int = 32
    pp: int = 8
    dp: int = 128
    model: ModelConfig = field(default_factory=ModelConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    days: float = 15.0
    seed: int = 0

    @property
    def n_groups(self) -> int:
        return self.dp * self.pp

    @property
    def groups_per_domain(self) -> int:
        return self.domain_size // self.tp

    @property
    def spare_groups(self) -> int:
        return self.policy.spare_domains * self.groups_per_domain

    @property
    def sequences_per_replica(self) -> int:
        return self.model.tokens_per_batch // (self.model.shape.seq_len * self.dp)

    @property
    def min_tp(self) -> int:
        return min_tensor_parallel(self.tp, self.policy.min_tp)

    def validate(self) -> SimConfig:
        """Raise ConfigError naming the first inconsistent field; return self when valid.

        The model shape validates itself on construction (`tessera_core.plan.ModelShape`).
        """
        _positive(self, "", ("gpus", "domain_size", "tp", "pp", "dp", "days"))
        _at_most(self, "", {"tp": MAX_TP, "pp": MAX_PP, "dp": MAX_DP, "days": MAX_DAYS})
        _at_most(self, "", {"gpus": MAX_GPUS, "seed": MAX_EXACT_INT})
        if self.seed < 0:
            # numpy's SeedSequence takes only non-negative entropy
            raise ConfigError("seed", f"seed must be >= 0, got {self.seed}")
        _at_most(self.model.shape, "model.", MAX_MODEL)
        _positive(self.model, "model.", ("tokens_per_batch",))
        _at_most(self.model, "model.", {"tokens_per_batch": MAX_EXACT_INT})
        _positive(
            self.failures,
            "failures.",
            ("hardware_repair_days", "software_repair_hours", "blast_radius"),
        )
        _at_most(
            self.failures,
            "failures.",
            {"hardware_repair_days": MAX_DAYS, "software_repair_hours": 24 * MAX_DAYS},
        )
        if self.tp * self.pp * self.dp != self.gpus:
            raise ConfigError(
                "gpus",
                f"tp x pp x dp = {self.tp} x {self.pp} x {self.dp} = "
                f"{self.tp * self.pp * self.dp}, but gpus = {self.gpus}",
            )
        if self.domain_size % self.tp:
            raise ConfigError(
                "domain_size",
                f"a TP group must fit inside one scale-up domain: domain_size {self.domain_size} "
                f"is not a multiple of tp {self.tp}",
            )
        if self.gpus % self.domain_size:
            raise ConfigError(
                "gpus", f"gpus {self.gpus} is not a whole number of {self.domain_size}-GPU domains"
            )
        if self.domain_size % self.failures.blast_radius:
            raise ConfigError(
                "failures.blast_radius",
                f"failures.blast_radius {self.failures.blast_radius} must divide "
                f"domain_size {self.domain_size}",
            )
        shape = self.model.shape
        if shape.n_heads < self.tp:
            raise ConfigError(
                "tp", f"tp {self.tp} exceeds the model's {shape.n_heads} attention heads"
            )
        per_step = shape.seq_len * self.dp
        if self.model.tokens_per_batch % per_step:
            sequences = max(1, round(self.model.tokens_per_batch / per_step))
            raise ConfigError(
                "model.tokens_per_batch",
                f"model.tokens_per_batch {self.model.tokens_per_batch} is not a whole number of "
                f"{shape.seq_len}-token sequences for each of {self.dp} DP replicas "
                f"(e.g. {sequences * per_step} = {sequences} per replica)",
            )
        f = self.failures
        _non_negative(f, "failures.", ("rate_per_gpu_day",))
        if not 0.0 <= f.hardware_share <= 1.0:
            raise ConfigError(
                "failures.hardware_share",
                f"failures.hardware_share must be in [0, 1], got {f.hardware_share}",
            )
        if f.repair_distribution not in ("fixed", "exponential"):
            raise ConfigError(
                "failures.repair_distribution",
                f"failures.repair_distribution must be 'fixed' or 'exponential', "
                f"got {f.repair_distribution!r}",
            )
        p = self.policy
        _non_negative(p, "policy.", ("power_headroom",))
        if p.power_headroom > MAX_HEADROOM:
            raise ConfigError(
                "policy.power_headroom",
                f"policy.power_headroom must be at most {MAX_HEADROOM:.4f}, got "
                f"{p.power_headroom!r}: the power model's speed peaks at "
                f"+{100 * MAX_HEADROOM:.1f}% power, more buys nothing",
            )
        if not 0 <= p.min_tp <= self.tp:
            raise ConfigError(
                "policy.min_tp", f"policy.min_tp must be in [0, tp={self.tp}], got {p.min_tp}"
            )
        _non_negative(
            p,
            "policy.",
            (
                "spare_domains",
                "restart_minutes",
                "checkpoint_interval_minutes",
                "reconfigure_seconds",
                "spare_swap_seconds",
            ),
        )
        _at_most(
            p,
            "policy.",
            {
                "restart_minutes": 1440 * MAX_DAYS,
                "checkpoint_interval_minutes": 1440 * MAX_DAYS,
                "reconfigure_seconds": 86_400 * MAX_DAYS,
                "spare_swap_seconds": 86_400 * MAX_DAYS,
            },
        )
        total = self.gpus + self.spare_groups * self.tp
        if total > MAX_GPUS:
            raise ConfigError(
                "policy.spare_domains",
                f"policy.spare_domains {p.spare_domains:,} x {self.domain_size} GPUs and the "
                f"job's {self.gpus:,} make {total:,} GPUs; at most {MAX_GPUS:,} together",
            )
        return self


# NaN passes no comparison and inf passes every lower bound, so each bound also needs finiteness.
def _positive(section: object, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(section, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(
                prefix + name, f"{prefix}{name} must be positive and finite, got {value!r}"
            )


def _at_most(section: object, prefix: str, bounds: dict[str, float]) -> None:
    for name, bound in bounds.items():
        value = getattr(section, name)
        if value > bound:
            raise ConfigError(
                prefix + name, f"{prefix}{name} must be at most {_num(bound)}, got {value!r}"
            )


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:,g}"


def _non_negative(section: object, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(section, name)
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(
                prefix + name, f"{prefix}{name} must be >= 0 and finite, got {value!r}"
            )
