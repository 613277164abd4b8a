"""Sharded checkpoints (torch.distributed.checkpoint): each rank writes the units it holds, and a
rank of any later layout reads only the units it needs.

A job's checkpoint directory holds complete checkpoints `step-00000016/` (DCP's files and
`.metadata`, plus `tessera.json`: step, data position, model arguments, layout). One is written
as `step-00000016.partial/` and renamed once every rank's part and the metadata are on disk, so a
half-written checkpoint is never loaded; the last `keep` are kept.

Keys are `model/<name>`, `exp_avg/<name>` and `exp_avg_sq/<name>` with the dense (whole-model)
shape, and `rng/cpu`. A rank's local tensor goes in as it is, with the DCP "checkpointable
tensor" fields saying which runs of its rows or columns are which global ones: NTP holds any set
of units, so one local tensor is several chunks, and nothing is gathered or copied dense.
Replica 0 writes (each unit once: KV copies at their lowest holder, replicated tensors at its
rank 0); every replica holds the same state.

A job may also start from a Hugging Face directory (`--init HF_DIR`): `latest`, `read_args` and
`load_state` take one wherever they take a checkpoint, and each rank reads its units of it
(`ntp.hf_read`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from ntp import hf, hf_read
from ntp.model import ModelArgs
from ntp.sharding import counted_units, dense_shape, local_positions, runs, spec_of, unit_size
from tessera_contracts.model_shape import FAMILY_FIELDS, SPEC_FIELDS, ModelShape
from tessera_core.plan import RankShard

MOMENTS = ("exp_avg", "exp_avg_sq")
PARTS = ("model", *MOMENTS)
INFO = "tessera.json"
PARTIAL = ".partial"
_NAME = re.compile(r"step-(\d{8})")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, or a path that holds none."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    return _NAME.fullmatch(path.name) is not None and (path / INFO).is_file()


def latest(path: Path) -> Path | None:
    """The newest complete checkpoint under a job's checkpoint directory, or `path` itself
    when it is one (or a Hugging Face directory); None when there is none yet."""
    if is_complete(path) or hf.is_directory(path):
        return path
    if not path.is_dir():
        return None
    done = sorted(p for p in path.iterdir() if p.is_dir() and is_complete(p))
    return done[-1] if done else None


def read_info(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / INFO).read_text())


def read_args(checkpoint: Path) -> ModelArgs:
    """The model a checkpoint (or a Hugging Face directory) holds."""
    if hf.is_directory(checkpoint):
        return hf.args_from_config(hf.read_config(checkpoint))
    return ModelArgs(**read_info(checkpoint)["model"])


def check_model(source: str, held: ModelShape, shape: ModelShape) -> None:
    """Refuse weights of another model than `shape` (the job's spec.model), naming the first
    field of spec.model that differs (the sequence length may)."""
    theirs, ours = held.to_spec(), shape.to_spec()
    for key in (*SPEC_FIELDS, *FAMILY_FIELDS):
        if key != "seqLen" and theirs.get(key) != ours.get(key):
            raise CheckpointError(
                f"{source} holds another model than spec.model: its {key} is "
                f"{theirs.get(key)!r}, spec.model's {ours.get(key)!r}"
            )


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP without a process group, on purpose: every rank reads on its own, and the tools run
    in one process (DCP warns that it assumes so)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _key(part: str, name: str) -> str:
    return f"{part}/{name}"


# -- a local tensor as chunks of the dense one -------------------------------------------------


def as_chunks(
    t: torch.Tensor, name: str, shape: ModelShape, held: Sequence[int], units: Sequence[int]
) -> torch.Tensor:
    """An alias of the local tensor `t` (holding `held`) that DCP writes or reads as the
    chunks of `units` of the dense tensor."""
    spec = spec_of(name)
    assert spec is not None
    size = unit_size(shape, spec.kind)
    alias = t.detach().view_as(t)
    offsets, local, sizes = [], [], []
    for first, at, n in runs(list(units), local_positions(held, units)):
        o, lo, sz = [0] * t.dim(), [0] * t.dim(), list(t.shape)
        o[spec.dim], lo[spec.dim], sz[spec.dim] = first * size, at * size, n * size
        offsets.append(tuple(o))
        local.append(tuple(lo))
        sizes.append(tuple(sz))
    alias.global_shape = tuple(dense_shape(shape, name, t.shape))
    alias.global_offsets = tuple(offsets)
    alias.local_offsets = tuple(local)
    alias.local_sizes = tuple(sizes)
    return alias


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[
    tuple[str, str, torch.Tensor]
]:
    """(part, parameter name, tensor) for weights and, where the optimizer has them, moments."""
    for name, p in model.named_parameters():
        yield "model", name, p
        state = {} if optimizer is None else optimizer.state.get(p, {})
        for m in MOMENTS:
            if m in state:
                yield m, name, state[m]


def save_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    shape: ModelShape,
    shards: Sequence[RankShard],
    rank: int,
) -> dict[str, torch.Tensor]:
    """What rank `rank` of replica 0 writes: its counted units and, at rank 0, the replicated
    tensors and the RNG state. Views of the live tensors (stage them before training on)."""
    state: dict[str, torch.Tensor] = {}
    held = shards[rank]
    for part, name, t in _tensors(model, optimizer):
        spec = spec_of(name)
        if spec is None:
            if rank == 0:
                state[_key(part, name)] = t.detach()
            continue
        units = counted_units(shards, rank, spec.kind)
        if units:
            state[_key(part, name)] = as_chunks(t, name, shape, held.units(spec.kind), units)
    if rank == 0:
        state["rng/cpu"] = torch.get_rng_state()
    return state


def staged(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy of `state` keeping each tensor's chunk fields: what an asynchronous save
    writes while training goes on."""
    out = {}
    for key, t in state.items():
        copy = t.detach().to("cpu", copy=True)
        for attr in ("global_shape", "global_offsets", "local_offsets", "local_sizes"):
            if hasattr(t, attr):
                setattr(copy, attr, getattr(t, attr))
        out[key] = copy
    return out


def moment_chunks(
    moments: Mapping[str, Sequence[torch.Tensor]],
    owned: Mapping[str, Sequence[int] | None],
    shape: ModelShape,
) -> dict[str, torch.Tensor]:
    """Sharded optimizer state as DCP entries: each parameter's moments (`MOMENTS` order) over
    the units `owned[name]` lists (None: a replicated tensor, whole); nothing for no units."""
    state: dict[str, torch.Tensor] = {}
    for name, tensors in moments.items():
        units = owned[name]
        for part, t in zip(MOMENTS, tensors, strict=True):
            if units is None:
                state[_key(part, name)] = t.detach()
            elif units:
                state[_key(part, name)] = as_chunks(t, name, shape, units, units)
    return state


def load_moments(
    checkpoint: Path,
    moments: Mapping[str, Sequence[torch.Tensor]],
    owned: Mapping[str, Sequence[int] | None],
    shape: ModelShape,
) -> bool:
    """Read the owned units' moments of any checkpoint into `moments` (see `moment_chunks`);
    False (nothing read) when the checkpoint holds no optimizer state."""
    reader = dcp.FileSystemReader(checkpoint)
    stored = reader.read_metadata().state_dict_metadata
    if not all(_key(m, n) in stored for n in moments for m in MOMENTS):
        return False
    state = moment_chunks(moments, owned, shape)
    if state:
        with torch.no_grad(), _one_process():
            dcp.load(state, storage_reader=reader, no_dist=True)
    return True


# -- load into any layout ----------------------------------------------------------------------


def _check_fits(
    checkpoint: Path, stored: Mapping[str, Any], model: nn.Module, shape: ModelShape
) -> bool:
    """Refuse a checkpoint of another model; True when it holds the AdamW moments too."""
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if _key("model", n) not in stored]
    if missing:
        raise CheckpointError(
            f"checkpoint {checkpoint} lacks {len(missing)} of the model's weights "
            f"(e.g. {missing[0]}): it is of another model"
        )
    for name, p in model.named_parameters():
        want = tuple(dense_shape(shape, name, p.shape))
        got = tuple(stored[_key("model", name)].size)
        if got != want:
            raise CheckpointError(
                f"checkpoint {checkpoint} has {name} of shape {got}, this model needs {want}: "
                "the checkpoint is of a model of another shape"
            )
    return all(_key(m, n) in stored for m in MOMENTS for n in names)


def load_state(
    checkpoint: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    shape: ModelShape,
    shard: RankShard,
) -> dict[str, Any]:
    """Read this rank's units of a checkpoint into a model of any layout (and its AdamW moments
    when `optimizer` is given and the checkpoint has them); returns the checkpoint's info.

    Every rank reads on its own (no collective): only the chunks overlapping its units. A
    Hugging Face directory is read the same way, as a checkpoint at step 0 without moments."""
    if hf.is_directory(checkpoint):
        return _load_hf(checkpoint, model, shape, shard)
    reader = dcp.FileSystemReader(checkpoint)
    stored = reader.read_metadata().state_dict_metadata
    with_moments = _check_fits(checkpoint, stored, model, shape) and optimizer is not None
    info = read_info(checkpoint)
    check_model(f"checkpoint {checkpoint}", ModelArgs(**info["model"]).shape(), shape)
    if with_moments:
        assert optimizer is not None
        for p in model.parameters():
            optimizer.state[p] = {
                "step": torch.tensor(float(info["step"])),
                **{m: torch.zeros_like(p) for m in MOMENTS},
            }
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for part, name, t in _tensors(model, optimizer if with_moments else None):
            spec = spec_of(name)
            held = () if spec is None else shard.units(spec.kind)
            state[_key(part, name)] = (
                t.detach() if spec is None else as_chunks(t, name, shape, held, held)
            )
        if "rng/cpu" in stored:
            state["rng/cpu"] = torch.get_rng_state()
        with _one_process():
            dcp.load(state, storage_reader=reader, no_dist=True)
    if "rng/cpu" in state:
        torch.set_rng_state(state["rng/cpu"])
    return info


def _load_hf(directory: Path, model: nn.Module, shape: ModelShape, shard: RankShard
             ) -> dict[str, Any]:
    config = hf.read_config(directory)
    try:
        held = hf.args_from_config(config, seq_len=shape.seq_len)
    except ValueError as exc:
        raise CheckpointError(f"{directory}: {exc}") from None
    check_model(f"{directory / hf.CONFIG}", held.shape(), shape)
    hf_read.load_units(directory, hf_read.open_directory(directory, held), model, shape, shard)
    return {"step": 0, "samples": 0, "model": asdict(held)}


# -- one process: dense tensors in and out (Hugging Face import and export) -------------------


class _LazyPlanner(DefaultSavePlanner):
    """Plans from placeholders of the right shape; each tensor is made only when the writer
    reaches it. With a file per tensor the writer asks for the next tensor once the last one is
    written, but still holds a reference to that one: its memory is released then."""

    def __init__(self, make: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._make = make
        self._last: torch.Tensor | None = None

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        if self._last is not None:
            self._last.untyped_storage().resize_(0)
        self._last = self._make(write_item.index.fqn)
        return self._last


def write_dense(
    root: Path, shapes: Mapping[str, Sequence[int]], make: Callable[[str], torch.Tensor],
    args: ModelArgs, step: int = 0,
) -> Path:
    """A complete checkpoint of dense float32 weights (no optimizer state) at
    root/step-NNNNNNNN, written by this one process, which holds one tensor at a time
    (`make(name)` gives it when its turn comes: a tensor of its own, whose memory is released
    once written); returns its path."""
    placeholders = {_key("model", name): torch.empty(tuple(shape), device="meta")
                    for name, shape in shapes.items()}
    final = root / checkpoint_name(step)
    partial = final.with_name(final.name + PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    prefix = _key("model", "")
    with _one_process():
        # a file per tensor: DCP keeps every tensor it wrote to a file until the file is done,
        # and resolves one file's tensors before writing them
        dcp.save(placeholders, no_dist=True,
                 storage_writer=dcp.FileSystemWriter(partial, single_file_per_rank=False),
                 planner=_LazyPlanner(lambda key: make(key[len(prefix):]).detach().cpu()))
    return _commit(partial, final, {"step": step, "samples": 0, "model": asdict(args)})


def dense_shapes(checkpoint: Path, part: str = "model") -> dict[str, tuple[int, ...]]:
    """The dense shape of every tensor of one part ("model", "exp_avg" or "exp_avg_sq")."""
    stored = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    prefix = f"{part}/"
    return {key[len(prefix):]: tuple(stored[key].size)
            for key in sorted(k for k in stored if k.startswith(prefix))}


def read_dense(
    checkpoint: Path, name: str, part: str = "model", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One dense tensor of a checkpoint (converted to `dtype` as it is read)."""
    key = _key(part, name)
    meta = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata[key]
    t = torch.empty(tuple(meta.size), dtype=dtype or meta.properties.dtype)
    with _one_process():
        dcp.load({key: t}, storage_reader=dcp.FileSystemReader(checkpoint), no_dist=True)
    return t


def iter_dense(checkpoint: Path, part: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
    """The dense tensors of one part, one at a time."""
    for name in dense_shapes(checkpoint, part):
        yield name, read_dense(checkpoint, name, part)


def dense_state(checkpoint: Path) -> dict[str, Any]:
    """The whole checkpoint dense, {"model": {...}, "optimizer": {moment: {...}, "step"} | None}:
    for tests and tools on small models (a training rank never builds it)."""
    moments = {m: dict(iter_dense(checkpoint, m)) for m in MOMENTS}
    info = read_info(checkpoint)
    optimizer = None if not all(moments.values()) else {**moments, "step": float(info["step"])}
    return {"model": dict(iter_dense(checkpoint)), "optimizer": optimizer}


# -- the job's checkpoints: written in the background, committed, pruned -----------------------


def _commit(partial: Path, final: Path, info: Mapping[str, Any]) -> Path:
    (partial / INFO).write_text(json.dumps(info))
    if final.exists():  # the same step again (redone after a restore): the newer replaces it
        shutil.rmtree(final)
    os.replace(partial, final)
    return final


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and partials older than the
    newest complete one (left by a generation that failed while saving)."""
    done = sorted(p for p in root.iterdir() if p.is_dir() and is_complete(p))
    newest = done[-1].name if done else ""
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for p in root.iterdir():
        if p.name.endswith(PARTIAL) and p.name[: -len(PARTIAL)] < newest:
            shutil.rmtree(p, ignore_errors=True)


def _in_background(work: Callable[[], None]) -> Future[None]:
    """`work` in a daemon thread: one abandoned in a collective that never returns must not
    hold up the process's exit (as the trainer's own threads, `ntp.train`)."""
    done: Future[None] = Future()

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=run, name="checkpoint", daemon=True).start()
    return done


class CheckpointSaver:
    """Writes a job's checkpoints under `root`, one at a time.

    `save` returns once the state is staged (copied to CPU memory); the write, DCP's metadata
    and the commit follow in a thread of their own, on a process group of their own so
    that they never interleave with training collectives. `blocking=True` writes before
    returning (the comparison the benchmark makes).
    """

    def __init__(self, root: Path, keep: int = 3, blocking: bool = False) -> None:
        self.root = root
        self.keep = keep
        self.blocking = blocking
        self._pending: Future[None] | None = None

    def save(
        self,
        state: Mapping[str, torch.Tensor],
        info: Mapping[str, Any],
        group: dist.ProcessGroup,
        coordinator: bool,
    ) -> None:
        """Collective over `group` (every rank of the job, each with its own `state`)."""
        self.wait()
        final = self.root / checkpoint_name(int(info["step"]))
        partial = final.with_name(final.name + PARTIAL)
        # A partial directory a failed save left at this step is written over: the metadata
        # written last names only this save's files.
        copy = staged(state)

        def write() -> None:
            dcp.save(copy, checkpoint_id=partial, process_group=group)
            if coordinator:
                _commit(partial, final, info)
                prune(self.root, self.keep)

        if self.blocking:
            write()
        else:
            self._pending = _in_background(write)

    def wait(self) -> None:
        """Until the previous save is committed (its failure raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def abandon(self) -> None:
        """Forget a save whose generation ended: its collectives fail with the generation's
        and its partial directory is never committed (`prune` removes it later)."""
        self._pending = None
