"""The generation contract: the typed, versioned layout document the operator writes (pure).

One document per layout generation says everything a trainer rank needs and nothing else; the
words are the CRD's (`spec.model`'s field names, `failurePolicy.mode`'s values, GPUs as
`NODE/INDEX` as in `status.replicas[].failedGPUs`, generations as `status.layoutGeneration`
counts them, the first published layout being generation 1).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera_contracts.model_shape import SPEC_FIELDS, ModelShape, PlanError
from tessera_contracts.vocabulary import FailurePolicy

SCHEMA_VERSION = 1
KIND = "NTPGeneration"
LAYOUT_KEY = "generation.json"  # the key of the layout ConfigMap that holds the document


def layout_configmap(job: str) -> str:
    """The name of the ConfigMap that holds `job`'s current generation (the operator writes it,
    the node agents watch it)."""
    return f"{job}-layout"




class GenerationError(ValueError):
    """A generation document that does not follow the contract; names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, order=True)
class Gpu:
    """A GPU's identity: the node it is on and its index there (`NODE/INDEX`)."""

    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}/{self.index}"

    @classmethod
    def parse(cls, text: object, field: str) -> Gpu:
        if not isinstance(text, str) or "/" not in text:
            raise GenerationError(field, f"a GPU is written NODE/INDEX, got {text!r}")
        node, _, index = text.rpartition("/")
        if not node or not index.isdigit():
            raise GenerationError(field, f"a GPU is written NODE/INDEX, got {text!r}")
        return cls(node, int(index))


@dataclass(frozen=True)
class Rendezvous:
    """Where the job's TCPStore listens (hosted by a launcher, never by a rank)."""

    host: str
    port: int

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}


@dataclass(frozen=True)
class Generation:
    """One layout generation of a job.

    `replicas[r][j]` is the GPU that rank j of DP replica r runs on; global ranks count replica
    by replica. `origin[d]` is the previous generation's global rank of the process that
    becomes global rank d, None for a process that starts holding nothing (a GPU back); the
    first generation has no origin. `at_step` (planned changes) switches every rank at the first
    step boundary at or after that step (the operator plans from reports that lag the ranks)
    where the processes it adds have come to its rendezvous; without it the generation follows
    a failure and ranks join it at once.
    """

    generation: int
    model: ModelShape
    global_batch: int
    mode: str
    replicas: tuple[tuple[Gpu, ...], ...]
    rendezvous: Rendezvous
    origin: tuple[int | None, ...] | None = None
    at_step: int | None = None

    def __post_init__(self) -> None:
        _check_int("generation", self.generation, 1)
        _check_int("globalBatch", self.global_batch, 1)
        if self.mode not in FailurePolicy.__members__.values():
            raise GenerationError(
                "mode", f"must be one of {', '.join(FailurePolicy)}, got {self.mode!r}")
        if not self.replicas or any(not r for r in self.replicas):
            raise GenerationError("replicas", "needs at least one replica, each with a GPU")
        gpus = self.gpus
        if len(set(gpus)) != len(gpus):
            raise GenerationError("replicas", "a GPU appears twice")
        if self.origin is not None:
            if self.generation == 1:
                raise GenerationError("origin", "the first generation has no previous one")
            if len(self.origin) != len(gpus):
                raise GenerationError(
                    "origin", f"needs one entry per rank ({len(gpus)}), got {len(self.origin)}"
                )
            kept = [o for o in self.origin if o is not None]
            if any(not isinstance(o, int) or isinstance(o, bool) or o < 0 for o in kept):
                raise GenerationError("origin", "entries are previous global ranks or null")
            if len(set(kept)) != len(kept):
                raise GenerationError("origin", "a previous rank carries on twice")
        elif self.generation > 1:
            raise GenerationError("origin", "is required after the first generation")
        if self.at_step is not None:
            _check_int("atStep", self.at_step, 0)
        if not self.rendezvous.host:
            raise GenerationError("rendezvous.host", "must not be empty")
        _check_int("rendezvous.port", self.rendezvous.port, 1)
        if self.rendezvous.port > 65535:
            raise GenerationError(
                "rendezvous.port", f"must be a TCP port, got {self.rendezvous.port}"
            )

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """Every rank's GPU, by global rank."""
        return tuple(g for replica in self.replicas for g in replica)

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.replicas)

    def rank_of(self, gpu: Gpu) -> int | None:
        """The global rank that runs on `gpu`, None if none does."""
        gpus = self.gpus
        return gpus.index(gpu) if gpu in gpus else None

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "kind": KIND,
            "schemaVersion": SCHEMA_VERSION,
            "generation": self.generation,
            "model": self.model.to_spec(),
            "globalBatch": self.global_batch,
            "mode": self.mode,
            "replicas": [{"gpus": [str(g) for g in r]} for r in self.replicas],
            "rendezvous": self.rendezvous.to_dict(),
        }
        if self.origin is not None:
            document["origin"] = list(self.origin)
        if self.at_step is not None:
            document["atStep"] = self.at_step
        return document

    @classmethod
    def from_dict(cls, data: object) -> Generation:
        """Parse and validate; a GenerationError names the first field that is wrong."""
        if not isinstance(data, Mapping):
            raise GenerationError("document", f"must be an object, got {type(data).__name__}")
        if data.get("kind") != KIND:
            raise GenerationError("kind", f"must be {KIND!r}, got {data.get('kind')!r}")
        version = data.get("schemaVersion")
        if version != SCHEMA_VERSION:
            raise GenerationError(
                "schemaVersion", f"this trainer reads version {SCHEMA_VERSION}, got {version!r}"
            )
        model = _mapping(data, "model")
        for key in SPEC_FIELDS:
            _check_int(f"model.{key}", model.get(key), 1)
        try:
            shape = ModelShape.from_spec(model)
        except PlanError as exc:
            raise GenerationError("model", str(exc)) from exc
        replicas = data.get("replicas")
        if not isinstance(replicas, list):
            raise GenerationError("replicas", "must be a list of {gpus: [NODE/INDEX, ...]}")
        parsed = []
        for r, replica in enumerate(replicas):
            gpus = replica.get("gpus") if isinstance(replica, Mapping) else None
            if not isinstance(gpus, list):
                raise GenerationError(f"replicas[{r}].gpus", "must be a list of NODE/INDEX")
            parsed.append(
                tuple(Gpu.parse(g, f"replicas[{r}].gpus[{j}]") for j, g in enumerate(gpus))
            )
        rendezvous = _mapping(data, "rendezvous")
        if not isinstance(rendezvous.get("host"), str):
            raise GenerationError("rendezvous.host", "must be a string")
        origin = data.get("origin")
        if origin is not None and not isinstance(origin, list):
            raise GenerationError("origin", "must be a list of previous ranks or null")
        return cls(
            generation=data.get("generation"),  # type: ignore[arg-type]  # checked on init
            model=shape,
            global_batch=data.get("globalBatch"),  # type: ignore[arg-type]
            mode=data.get("mode"),  # type: ignore[arg-type]
            replicas=tuple(parsed),
            rendezvous=Rendezvous(rendezvous["host"], rendezvous.get("port")),  # type: ignore[arg-type]
            origin=None if origin is None else tuple(origin),
            at_step=data.get("atStep"),
        )


def _mapping(data: Mapping[str, Any], field: str) -> Mapping[str, Any]:
    value = data.get(field)
    if not isinstance(value, Mapping):
        raise GenerationError(field, "must be an object")
    return value


def _check_int(field: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise GenerationError(field, f"must be an integer >= {minimum}, got {value!r}")


def derive_origin(
    previous: Generation,
    replicas: Sequence[Sequence[Gpu]],
    lost: Collection[Gpu] = (),
) -> tuple[int | None, ...]:
    """Which previous rank becomes each new rank: the process on the same GPU carries on.

    A GPU of the new layout that the previous one did not use, or whose process died (`lost`),
    starts a fresh process (None). Processes of the previous generation on GPUs that are not in
    the new layout leave.
    """
    return tuple(
        None if gpu in lost else previous.rank_of(gpu) for replica in replicas for gpu in replica
    )
def next_generation(
    previous: Generation,
    replicas: Sequence[Sequence[Gpu]],
    lost: Collection[Gpu] = (),
    at_step: int | None = None,
) -> Generation:
    """The generation after `previous` on `replicas`: same job, origin by GPU identity."""
    return Generation(
        generation=previous.generation + 1,
        model=previous.model,
        global_batch=previous.global_batch,
        mode=previous.mode,
        replicas=tuple(tuple(r) for r in replicas),
        rendezvous=previous.rendezvous,
        origin=derive_origin(previous, replicas, lost),
        at_step=at_step,
    )
