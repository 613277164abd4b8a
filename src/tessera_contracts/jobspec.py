"""An NTPTrainingJob's spec as one typed value, with the CRD's defaults: the schema is their source.

The API server fills every `default:` of the schema before anyone reads a stored job (structural
defaulting); `defaulted` does the same for a spec that never went through one (a test, the
simulator, a dry run), so no reader writes a default of its own and none can disagree with the CRD.
`NTPTrainingJobSpec.from_spec` reads a whole spec, defaulted, into frozen values named after the
CRD's fields, checking what the schema checks of their presence and types (a spec the API server
would not store is a `SpecError` naming the field); `to_spec` gives it back as the API server
stores it. What a spec must be beyond its schema (a model shape that splits into heads, a power
policy that holds) is for its readers to say: the operator's planner.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera_contracts import api
from tessera_contracts.model_shape import ModelShape
from tessera_contracts.vocabulary import FailurePolicy


class SpecError(ValueError):
    """A job spec that cannot be used; `field` is the spec path to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field


def defaulted(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `spec` with every field the CRD defaults filled in, as the API server does:
    a missing field takes its default, then defaulting goes on inside what is there."""
    return _apply(api.job_schema(), copy.deepcopy(dict(spec)))


def _apply(schema: Mapping[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _apply(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply(schema["items"], item) for item in value]
    return value


def schema_default(path: str) -> Any:
    """The CRD's default for a dotted spec path such as `failurePolicy.mode`."""
    schema: Mapping[str, Any] = api.job_schema()
    for name in path.split("."):
        schema = schema["properties"][name]
    return copy.deepcopy(schema["default"])


# ----------------------------------------------------------------------------------------------
# The typed spec
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """`spec.model`: a decoder's dimensions and what its family adds, as written (`shape` says
    whether they make one; a family field left out is absent here too)."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    layers: int
    seq_len: int
    head_dim: int | None = None
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    tied_embeddings: bool | None = None
    sliding_window: int | None = None
    rope_scaling: Mapping[str, Any] | None = None  # as written: `shape` checks it

    def to_spec(self) -> dict[str, Any]:
        return {"hidden": self.hidden, "heads": self.heads, "kvHeads": self.kv_heads,
                "ffn": self.ffn, "vocab": self.vocab, "layers": self.layers,
                "seqLen": self.seq_len} | _present(
            headDim=self.head_dim, qkvBias=self.qkv_bias, qkNorm=self.qk_norm,
            tiedEmbeddings=self.tied_embeddings, slidingWindow=self.sliding_window,
            ropeScaling=None if self.rope_scaling is None else dict(self.rope_scaling))

    def shape(self) -> ModelShape:
        """The decoder this spec describes; PlanError when it describes none."""
        return ModelShape.from_spec(self.to_spec())


def min_tensor_parallel(tp: int, configured: int | None) -> int:
    """The lowest TP degree a replica of healthy degree `tp` may shrink to: the configured
    failurePolicy.minTensorParallelSize, else half the healthy degree."""
    return configured or max(1, tp // 2)


@dataclass(frozen=True)
class FailurePolicySpec:
    """`spec.failurePolicy`."""

    mode: FailurePolicy
    min_tensor_parallel_size: int | None  # None: not set (half the healthy TP)
    health_sources: tuple[str, ...]
    max_restarts: int
    rank_death_hold_seconds: int
    fatal_xids: tuple[int, ...]
    pod_start_timeout_seconds: int
    on_pod_start_timeout: str  # Restart or Fail

    def to_spec(self) -> dict[str, Any]:
        return {"mode": str(self.mode), "healthSources": list(self.health_sources),
                "maxRestarts": self.max_restarts,
                "rankDeathHoldSeconds": self.rank_death_hold_seconds,
                "fatalXIDs": list(self.fatal_xids),
                "podStartTimeoutSeconds": self.pod_start_timeout_seconds,
                "onPodStartTimeout": self.on_pod_start_timeout} | _present(
            minTensorParallelSize=self.min_tensor_parallel_size)


@dataclass(frozen=True)
class PowerPolicySpec:
    """`spec.powerPolicy`, in watts."""

    base_cap_watts: int
    boost_cap_watts: int
    rack_budget_watts: int | None  # None: not set (the domain's GPUs at the base cap)
    ramp_step_watts: int  # ramp.stepWatts

    def to_spec(self) -> dict[str, Any]:
        return {"baseCapWatts": self.base_cap_watts, "boostCapWatts": self.boost_cap_watts,
                "ramp": {"stepWatts": self.ramp_step_watts}} | _present(
            rackBudgetWatts=self.rack_budget_watts)


@dataclass(frozen=True)
class CheckpointPolicySpec:
    """`spec.checkpointPolicy`."""

    interval_steps: int
    keep: int
    path: str | None  # None: no checkpoints

    def to_spec(self) -> dict[str, Any]:
        return {"intervalSteps": self.interval_steps, "keep": self.keep} | _present(
            path=self.path)


@dataclass(frozen=True)
class DataSpec:
    """`spec.data`: the prepared dataset the job trains on."""

    path: str
    tokenizer: str | None

    def to_spec(self) -> dict[str, Any]:
        return {"path": self.path} | _present(tokenizer=self.tokenizer)


@dataclass(frozen=True)
class ActivationCheckpointingSpec:
    """`spec.activationCheckpointing`."""

    mode: str  # none, full, selective
    every: int

    def to_spec(self) -> dict[str, Any]:
        return {"mode": self.mode, "every": self.every}


@dataclass(frozen=True)
class ScheduleSpec:
    """`spec.optimizer.schedule`."""

    type: str  # constant, cosine, wsd
    warmup_steps: int
    decay_steps: int
    min_ratio: float

    def to_spec(self) -> dict[str, Any]:
        return {"type": self.type, "warmupSteps": self.warmup_steps,
                "decaySteps": self.decay_steps, "minRatio": self.min_ratio}


@dataclass(frozen=True)
class OptimizerSpec:
    """`spec.optimizer`."""

    learning_rate: float
    weight_decay: float
    weight_decay_all: bool
    schedule: ScheduleSpec
    sharded_state: bool

    def to_spec(self) -> dict[str, Any]:
        return {"learningRate": self.learning_rate, "weightDecay": self.weight_decay,
                "weightDecayAll": self.weight_decay_all, "schedule": self.schedule.to_spec(),
                "shardedState": self.sharded_state}


@dataclass(frozen=True)
class EvalSpec:
    """`spec.eval`: the loss on a held-out split."""

    every_steps: int
    samples: int

    def to_spec(self) -> dict[str, Any]:
        return {"everySteps": self.every_steps, "samples": self.samples}


@dataclass(frozen=True)
class NTPTrainingJobSpec:
    """An NTPTrainingJob's whole spec, defaulted as the API server stores it; each field is the
    CRD's of the same name (docs/crd-reference.md), None where an optional one is absent."""

    image: str
    command: tuple[str, ...] | None
    args: tuple[str, ...] | None
    model: ModelSpec
    tensor_parallel_size: int
    data_parallel_replicas: int
    pipeline_parallel_size: int
    gpus_per_node: int
    total_gpus: int
    scale_up_domain_label: str
    steps: int
    global_batch: int
    precision: str
    suspend: bool
    managed_by: str | None
    ttl_seconds_after_finished: int | None
    failure_policy: FailurePolicySpec
    power_policy: PowerPolicySpec | None
    checkpoint_policy: CheckpointPolicySpec
    data: DataSpec | None
    initial_weights: str | None  # initialWeights.path
    micro_batch_size: int | None  # None: each replica's share in one pass
    activation_checkpointing: ActivationCheckpointingSpec
    optimizer: OptimizerSpec
    eval: EvalSpec | None
    gpu_memory: str | None  # a quantity; None: the nodes' nvidia.com/gpu.memory label
    # The pod template as written: a Kubernetes PodTemplateSpec the operator merges its pods
    # into (shared, never changed).
    template: Mapping[str, Any]
    # The template's pod resource claim that holds the node's GPUs (DRA); None: the trainer
    # container asks for them as the extended resource nvidia.com/gpu.
    gpu_resource_claim: str | None = None

    @property
    def trainers(self) -> int:
        """The job's trainer pods: one per node."""
        return self.total_gpus // self.gpus_per_node

    @property
    def min_tensor_parallel_size(self) -> int:
        """The lowest TP degree a replica may shrink to: failurePolicy.minTensorParallelSize,
        else half the healthy degree."""
        return min_tensor_parallel(self.tensor_parallel_size,
                                   self.failure_policy.min_tensor_parallel_size)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> NTPTrainingJobSpec:
        """The typed value of `spec` (an API object's), defaulted as the CRD says; SpecError
        names the first field the schema would not have stored."""
        top = _Object(defaulted(spec), "")
        # In the order the operator has always named a spec's first problem: the model, the
        # failure policy's mode, the parallel sizes, then the rest.
        model = top.child("model")
        typed_model = ModelSpec(
            hidden=model.integer("hidden"), heads=model.integer("heads"),
            kv_heads=model.integer("kvHeads"), ffn=model.integer("ffn"),
            vocab=model.integer("vocab"), layers=model.integer("layers"),
            seq_len=model.integer("seqLen"), head_dim=model.optional_integer("headDim"),
            qkv_bias=model.optional_flag("qkvBias"), qk_norm=model.optional_flag("qkNorm"),
            tied_embeddings=model.optional_flag("tiedEmbeddings"),
            sliding_window=model.optional_integer("slidingWindow"),
            rope_scaling=rope.value if (rope := model.optional_child("ropeScaling")) else None)
        failure = top.child("failurePolicy")
        mode = failure.text("mode")
        if mode not in FailurePolicy.__members__.values():
            raise SpecError("failurePolicy.mode",
                            f"{mode!r} is not one of {', '.join(FailurePolicy)}")
        tp, dp = top.integer("tensorParallelSize"), top.integer("dataParallelReplicas")
        pp, per_node = top.integer("pipelineParallelSize"), top.integer("gpusPerNode")
        power = top.optional_child("powerPolicy")
        checkpoint = top.child("checkpointPolicy")
        data = top.optional_child("data")
        weights = top.optional_child("initialWeights")
        checkpointing = top.child("activationCheckpointing")
        optimizer = top.child("optimizer")
        schedule = optimizer.child("schedule")
        evaluation = top.optional_child("eval")
        return cls(
            image=top.text("image"), command=top.optional_texts("command"),
            args=top.optional_texts("args"), model=typed_model, tensor_parallel_size=tp,
            data_parallel_replicas=dp, pipeline_parallel_size=pp, gpus_per_node=per_node,
            total_gpus=top.integer("totalGPUs"),
            scale_up_domain_label=top.text("scaleUpDomainLabel"), steps=top.integer("steps"),
            global_batch=top.integer("globalBatch"), precision=top.text("precision"),
            suspend=top.flag("suspend"), managed_by=top.optional_text("managedBy"),
            ttl_seconds_after_finished=top.optional_integer("ttlSecondsAfterFinished"),
            failure_policy=FailurePolicySpec(
                mode=FailurePolicy(mode),
                min_tensor_parallel_size=failure.optional_integer("minTensorParallelSize"),
                health_sources=failure.texts("healthSources"),
                max_restarts=failure.integer("maxRestarts"),
                rank_death_hold_seconds=failure.integer("rankDeathHoldSeconds"),
                fatal_xids=failure.integers("fatalXIDs"),
                pod_start_timeout_seconds=failure.integer("podStartTimeoutSeconds"),
                on_pod_start_timeout=failure.choice("onPodStartTimeout", ("Restart", "Fail"))),
            power_policy=None if power is None else PowerPolicySpec(
                base_cap_watts=power.integer("baseCapWatts"),
                boost_cap_watts=power.integer("boostCapWatts"),
                rack_budget_watts=power.optional_integer("rackBudgetWatts"),
                ramp_step_watts=power.child("ramp").integer("stepWatts")),
            checkpoint_policy=CheckpointPolicySpec(
                interval_steps=checkpoint.integer("intervalSteps"),
                keep=checkpoint.integer("keep"), path=checkpoint.optional_text("path")),
            data=None if data is None else DataSpec(
                path=data.text("path"), tokenizer=data.optional_text("tokenizer")),
            initial_weights=None if weights is None else weights.text("path"),
            micro_batch_size=top.optional_integer("microBatchSize"),
            activation_checkpointing=ActivationCheckpointingSpec(
                mode=checkpointing.text("mode"), every=checkpointing.integer("every")),
            optimizer=OptimizerSpec(
                learning_rate=optimizer.number("learningRate"),
                weight_decay=optimizer.number("weightDecay"),
                weight_decay_all=optimizer.flag("weightDecayAll"),
                schedule=ScheduleSpec(
                    type=schedule.text("type"), warmup_steps=schedule.integer("warmupSteps"),
                    decay_steps=schedule.integer("decaySteps"),
                    min_ratio=schedule.number("minRatio")),
                sharded_state=optimizer.flag("shardedState")),
            eval=None if evaluation is None else EvalSpec(
                every_steps=evaluation.integer("everySteps"),
                samples=evaluation.integer("samples")),
            gpu_memory=top.optional_text("gpuMemory"),
            template=top.child("template").value,
            gpu_resource_claim=_gpu_claim(top))

    def to_spec(self) -> dict[str, Any]:
        """The spec as the API server stores it (`from_spec`'s inverse on a stored spec)."""
        return {
            "image": self.image, "model": self.model.to_spec(),
            "tensorParallelSize": self.tensor_parallel_size,
            "dataParallelReplicas": self.data_parallel_replicas,
            "pipelineParallelSize": self.pipeline_parallel_size,
            "gpusPerNode": self.gpus_per_node, "totalGPUs": self.total_gpus,
            "scaleUpDomainLabel": self.scale_up_domain_label, "steps": self.steps,
            "globalBatch": self.global_batch, "precision": self.precision,
            "suspend": self.suspend, "failurePolicy": self.failure_policy.to_spec(),
            "checkpointPolicy": self.checkpoint_policy.to_spec(), "template": self.template,
            "activationCheckpointing": self.activation_checkpointing.to_spec(),
            "optimizer": self.optimizer.to_spec(),
        } | _present(
            command=None if self.command is None else list(self.command),
            args=None if self.args is None else list(self.args),
            managedBy=self.managed_by, ttlSecondsAfterFinished=self.ttl_seconds_after_finished,
            powerPolicy=None if self.power_policy is None else self.power_policy.to_spec(),
            data=None if self.data is None else self.data.to_spec(),
            initialWeights=None if self.initial_weights is None else {
                "path": self.initial_weights},
            microBatchSize=self.micro_batch_size,
            eval=None if self.eval is None else self.eval.to_spec(),
            gpuMemory=self.gpu_memory,
            gpuResourceClaim=self.gpu_resource_claim)


def _gpu_claim(top: _Object) -> str | None:
    """`gpuResourceClaim`, which must name one of the template pod's resource claims."""
    claim = top.optional_text("gpuResourceClaim")
    if claim is None:
        return None
    pod = top.child("template").value.get("spec") or {}
    named = [c.get("name") for c in pod.get("resourceClaims") or [] if isinstance(c, Mapping)]
    if claim not in named:
        raise SpecError("gpuResourceClaim", f"names {claim!r}, which is not one of "
                        f"template.spec.resourceClaims ({', '.join(map(str, named)) or 'none'})")
    return claim


def _present(**fields: Any) -> dict[str, Any]:
    """The optional fields that are set (an absent one is left out, as the API server does)."""
    return {key: value for key, value in fields.items() if value is not None}


def _is(value: object, kind: Any) -> bool:
    # bool is an int in Python, never a count or a number in a spec
    return isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))


class _Object:
    """One object of a spec being read: each field checked for presence and type, a wrong one
    a SpecError naming its path."""

    def __init__(self, value: Mapping[str, Any], path: str) -> None:
        self.value, self._path = value, path

    def _at(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def _get(self, key: str, kind: Any, what: str, required: bool = True,
             item: type | None = None) -> Any:
        """The field `key` if it is a `kind` (a list of `item`s); None when it is absent and
        not `required`."""
        at = self._at(key)
        if key not in self.value:
            if required:
                raise SpecError(at, "is required")
            return None
        found = self.value[key]
        if not _is(found, kind) or (item is not None and not all(_is(i, item) for i in found)):
            raise SpecError(at, f"must be {what}, got {found!r}")
        return found

    def integer(self, key: str) -> int:
        return int(self._get(key, int, "an integer"))

    def optional_integer(self, key: str) -> int | None:
        return self._get(key, int, "an integer", required=False)

    def number(self, key: str) -> float:
        # as stored: an integral number stays an int, as the API server keeps it
        return self._get(key, int | float, "a number")

    def text(self, key: str) -> str:
        return str(self._get(key, str, "a string"))

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        found = self.text(key)
        if found not in allowed:
            raise SpecError(self._at(key), f"{found!r} is not one of {', '.join(allowed)}")
        return found

    def optional_text(self, key: str) -> str | None:
        return self._get(key, str, "a string", required=False)

    def flag(self, key: str) -> bool:
        return bool(self._get(key, bool, "true or false"))

    def optional_flag(self, key: str) -> bool | None:
        return self._get(key, bool, "true or false", required=False)

    def texts(self, key: str) -> tuple[str, ...]:
        return tuple(self._get(key, list, "a list of strings", item=str))

    def optional_texts(self, key: str) -> tuple[str, ...] | None:
        found = self._get(key, list, "a list of strings", required=False, item=str)
        return None if found is None else tuple(found)

    def integers(self, key: str) -> tuple[int, ...]:
        return tuple(self._get(key, list, "a list of integers", item=int))

    def child(self, key: str) -> _Object:
        return _Object(self._get(key, Mapping, "an object"), self._at(key))

    def optional_child(self, key: str) -> _Object | None:
        found = self._get(key, Mapping, "an object", required=False)
        return None if found is None else _Object(found, self._at(key))
