"""AdamW with its state sharded across the data-parallel replicas (ZeRO-1 over a nonuniform
layout): a rank keeps the fp32 master weights and AdamW moments of the units it owns
(`tessera_core.sharded_state`), updates them after the gradient sync, and sends each updated
unit to every other rank that holds it; `move_owned_state` carries the owned state to a new
layout.

AdamW is elementwise and the synchronized gradient of a unit is the same on every rank that
holds it, so the owner's update of its slice is the update every holder made without sharding.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ntp.checkpoint import MOMENTS, load_moments, moment_chunks
from ntp.config import TrainConfig
from ntp.recipe import parameter_groups
from ntp.reshard import move_parameter
from ntp.sharding import local_index, local_shape, pack_into, slice_elements, spec_of, unit_size
from ntp.sharding import unpack as unpack_into
from tessera_core.plan import JobLayout, RankShard
from tessera_core.sharded_state import HEAD_KINDS, owned_elements, owned_units, owner_replica

# name -> a parameter's owned AdamW moments (exp_avg, exp_avg_sq), as `MOMENTS` orders them
OwnedState = dict[str, list[torch.Tensor]]

_LAYER = re.compile(r"^layers\.(\d+)\.")


class LostOptimizerState(Exception):
    """A rank that kept optimizer state has no place in the new layout: what it kept is gone."""


def ownership_layer(name: str, kind: str) -> int:
    """The layer whose ownership a parameter of `kind` follows: its own for heads (owned layer
    by layer), 0 for the rest (owned alike in every layer)."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match and kind in HEAD_KINDS else 0


def replicated_indices(names: Sequence[str]) -> dict[str, int]:
    """Each replicated parameter's index among the replicated ones, by name (every rank and
    every layout numbers them alike)."""
    replicated = sorted(n for n in names if spec_of(n) is None)
    return {n: i for i, n in enumerate(replicated)}


def owner_rank(layout: JobLayout, index: int) -> int:
    """The global rank keeping the state of the `index`-th replicated tensor."""
    return layout.replicas[owner_replica("replicated", index, layout.tp_degrees)].global_rank(0)


def _owned_by(layout: JobLayout) -> Any:
    """global rank, layer -> the units that rank owns in that layer (cached per call site)."""

    @cache
    def owned(global_rank: int, layer: int) -> RankShard:
        replica, rank = layout.locate(global_rank)
        return owned_units(layout, replica, rank, layer)

    return owned


def check_survives(old: JobLayout, origin: Sequence[int | None]) -> None:
    """Refuse a relayout that leaves out a rank keeping optimizer state (`LostOptimizerState`):
    no other rank has a copy of it."""
    kept = set(origin)
    for g in range(old.world_size):
        if g not in kept and owned_elements(old, *old.locate(g)) > 0:
            raise LostOptimizerState(
                f"rank {g} of the old layout kept optimizer state and has no place in the new one"
            )


def exchange_routes(
    layout: JobLayout, global_rank: int, kind: str, layer: int, device: torch.device
) -> tuple[tuple[int, ...], torch.Tensor, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """This rank's owned units of `kind` in `layer`, their local indices, and per world rank
    the local indices of the owned units it holds (sent to it) and of the held units it owns
    (taken from it)."""
    owned = _owned_by(layout)
    shards = [layout.replicas[r].shards[j] for r, j in map(layout.locate,
                                                            range(layout.world_size))]
    held = shards[global_rank].units(kind)
    mine = owned(global_rank, layer).units(kind)
    sends: list[torch.Tensor | None] = []
    takes: list[torch.Tensor | None] = []
    for g in range(layout.world_size):
        theirs, holds = set(owned(g, layer).units(kind)), set(shards[g].units(kind))
        to = [u for u in mine if u in holds] if g != global_rank else []
        fro = [u for u in held if u in theirs] if g != global_rank else []
        sends.append(local_index(layout.shape, kind, held, to, device) if to else None)
        takes.append(local_index(layout.shape, kind, held, fro, device) if fro else None)
    return mine, local_index(layout.shape, kind, held, mine, device), sends, takes


@dataclass(frozen=True)
class _Route:
    """How one sharded parameter's updated units reach their holders."""

    dim: int
    owned: torch.Tensor  # this rank's owned units, as indices along its local split dimension
    sends: list[torch.Tensor | None]  # per world rank: local indices of owned units it holds
    takes: list[torch.Tensor | None]  # per world rank: local indices of held units it owns
    unit: int  # elements of one unit's slice


class ShardedAdamW:
    """torch's AdamW over this rank's owned slices, with the trainer's optimizer interface
    (`param_groups`, `state`, `step`, `zero_grad`)."""

    def __init__(self, model: torch.nn.Module, layout: JobLayout, global_rank: int,
                 group: dist.ProcessGroup, config: TrainConfig) -> None:
        self.model, self.layout, self.group = model, layout, group
        self.params = list(model.named_parameters())
        self.replicated = replicated_indices([n for n, _ in self.params])
        self.owned_units: dict[str, tuple[int, ...] | None] = {}  # None: a replicated tensor
        self.routes: dict[str, _Route] = {}
        masters: dict[str, torch.nn.Parameter] = {}
        planned: dict[tuple[str, int], Any] = {}  # (kind, layer) -> its routes
        # 1. What this rank owns of each parameter: a master copy of it, and its routes.
        for name, p in self.params:
            spec = spec_of(name)
            if spec is None:
                if owner_rank(layout, self.replicated[name]) == global_rank:
                    self.owned_units[name] = None
                    masters[name] = torch.nn.Parameter(p.detach().clone())
                continue
            layer = ownership_layer(name, spec.kind)
            if (spec.kind, layer) not in planned:
                planned[spec.kind, layer] = exchange_routes(layout, global_rank, spec.kind, layer,
                                                    p.device)
            mine, owned, sends, takes = planned[spec.kind, layer]
            unit = unit_size(layout.shape, spec.kind) * slice_elements(p, spec.dim)
            self.routes[name] = _Route(spec.dim, owned, sends, takes, unit)
            self.owned_units[name] = mine
            masters[name] = torch.nn.Parameter(p.detach().index_select(spec.dim, owned))
        self.masters = masters
        # 2. torch's AdamW over the masters, with the recipe's weight decay groups.
        self.inner = torch.optim.AdamW(
            parameter_groups(masters.items(), config.weight_decay, config.weight_decay_all),
            lr=config.lr, foreach=False,
        )
        # The model's weights are filled after the optimizer is built (initialized, loaded or
        # moved): the masters are taken from them at the first step.
        self._stale = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Mapping[Any, dict[str, Any]]:
        """AdamW's state, keyed by the master slices: none of the model's own parameters."""
        return self.inner.state

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        """Update the owned slices from the synchronized gradients, one parameter at a time
        (so only one slice's gradient copy lives at once), then send them to their holders."""
        if self._stale:
            self._load_masters()
        for name, p in self.params:
            master = self.masters.get(name)
            if master is None or p.grad is None:
                continue
            route = self.routes.get(name)
            master.grad = p.grad if route is None else p.grad.index_select(route.dim, route.owned)
            self.inner.step()
            master.grad = None
        for name, p in self.params:
            self._share(name, p)

    def _load_masters(self) -> None:
        for name, master in self.masters.items():
            p = self.model.get_parameter(name)
            route = self.routes.get(name)
            master.copy_(p if route is None else p.index_select(route.dim, route.owned))
        self._stale = False

    def _share(self, name: str, p: torch.nn.Parameter) -> None:
        """Write the owned slices into the model and exchange them with the other holders
        (collective over the generation's world, in the model's parameter order)."""
        weight, master = p.detach(), self.masters.get(name)
        route = self.routes.get(name)
        if route is None:  # replicated: its owner's copy, to everyone
            if master is not None:
                weight.copy_(master)
            dist.broadcast(weight, owner_rank(self.layout, self.replicated[name]),
                           group=self.group)
            return
        spec = spec_of(name)
        assert spec is not None and master is not None
        weight.index_copy_(route.dim, route.owned, master)
        out_sizes = [0 if i is None else i.numel() // unit_size(self.layout.shape, spec.kind)
                     * route.unit for i in route.sends]
        in_sizes = [0 if i is None else i.numel() // unit_size(self.layout.shape, spec.kind)
                    * route.unit for i in route.takes]
        outgoing = weight.new_empty(sum(out_sizes))
        offset = 0
        for index, size in zip(route.sends, out_sizes, strict=True):
            if index is not None:
                pack_into(outgoing[offset : offset + size], weight, spec, index)
                offset += size
        incoming = weight.new_empty(sum(in_sizes))
        dist.all_to_all_single(incoming, outgoing, in_sizes, out_sizes, group=self.group)
        offset = 0
        for index, size in zip(route.takes, in_sizes, strict=True):
            if index is not None:
                unpack_into(incoming[offset : offset + size], weight, spec, index)
                offset += size

    # -- the owned state: moved, saved, loaded -------------------------------------------------

    def owned_state(self) -> OwnedState:
        """Each owned slice's AdamW moments (none before the first step)."""
        return {name: [self.inner.state[m][k] for k in MOMENTS]
                for name, m in self.masters.items() if m in self.inner.state}

    def install(self, state: OwnedState, step: int) -> None:
        """Take moved moments, as AdamW holds them after `step` steps."""
        for name, master in self.masters.items():
            if name in state:
                self.inner.state[master] = {
                    "step": torch.tensor(float(step)),
                    **dict(zip(MOMENTS, state[name], strict=True)),
                }

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What this rank writes of the optimizer: its owned moments, as dense chunks."""
        return moment_chunks(self.owned_state(), self.owned_units, self.layout.shape)

    def load(self, checkpoint: Path, step: int) -> None:
        """This rank's owned moments from a checkpoint of any layout, sharded or not (none when
        it holds none)."""
        zeros = {n: [torch.zeros_like(m) for _ in MOMENTS] for n, m in self.masters.items()}
        if load_moments(checkpoint, zeros, self.owned_units, self.layout.shape):
            self.install(zeros, step)


def empty_owned(weights: Mapping[str, torch.Tensor], layout: JobLayout) -> OwnedState:
    """What a rank that kept nothing brings to `move_owned_state`: moments of no units."""
    return {name: [w.new_empty(local_shape(layout.shape, name, w.shape, RankShard()))
                   for _ in MOMENTS]
            for name, w in weights.items() if spec_of(name) is not None}


def move_owned_state(
    state: OwnedState,
    weights: Mapping[str, torch.Tensor],
    old: JobLayout,
    layout: JobLayout,
    origin: Sequence[int | None],
) -> OwnedState:
    """This rank's owned moments in `layout`, from the ranks that owned them in `old` (collective
    over the new world; every owner of `old` must be in `origin`: `check_survives`). `weights`:
    this rank's moved weights in `layout` (the shapes of what it receives)."""
    rank = dist.get_rank()
    old_rank = origin[rank]
    old_owned, new_owned = _owned_by(old), _owned_by(layout)
    replicated = replicated_indices(list(weights))
    out: OwnedState = {}
    for name in sorted(weights):
        spec = spec_of(name)
        if spec is None:  # replicated: from its old owner to its new one
            index = replicated[name]
            src = origin.index(owner_rank(old, index))
            moments = state[name] if rank == src else [
                torch.empty_like(weights[name]) for _ in MOMENTS]
            for t in moments:
                dist.broadcast(t, src)
            if owner_rank(layout, index) == rank:
                out[name] = [t.clone() if rank == src else t for t in moments]
            continue
        layer = ownership_layer(name, spec.kind)
        was = RankShard() if old_rank is None else old_owned(old_rank, layer)
        moves = _owned_moves(old_owned, new_owned, origin, spec.kind, layer)
        out[name] = move_parameter(state.pop(name), layout.shape, spec, was,
                                   new_owned(rank, layer), moves, rank, None, name)
    return out


def _owned_moves(old_owned: Any, new_owned: Any, origin: Sequence[int | None], kind: str,
                 layer: int) -> list[list[RankShard]]:
    """moves[d][s]: the owned units of `kind` new rank d takes from new rank s (as
    `tessera_core.plan.reshard_moves` says it for held units)."""
    before = [set() if o is None else set(old_owned(o, layer).units(kind)) for o in origin]
    return [[RankShard(**{kind: tuple(u for u in new_owned(d, layer).units(kind) if u in was)})
             for was in before] for d in range(len(origin))]
