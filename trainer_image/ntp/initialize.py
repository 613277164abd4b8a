"""Seeded initial weights computed per unit, so that a rank materializes only its own units.

A sharded tensor's values are drawn in blocks of consecutive units (about 64 Ki elements each,
from a generator seeded by the seed, the parameter's name and the block), laid out unit-major
(a unit's slice along the split dimension first), so a unit's values do not depend on who holds
it: every layout, and the dense model, starts from identical weights. A rank builds its model on
the meta device, gives it its shard's shapes (`ntp.parallelize.apply_ntp`), allocates them
(`materialize`) and fills them (`init_parameters`): it never holds more than its shard and one
block.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ntp.model import ModelArgs, Transformer, parameter_shapes
from ntp.sharding import ParamSpec, spec_of, unit_size
from tessera_core.plan import RankShard

BLOCK_ELEMENTS = 1 << 16


def _std(args: ModelArgs, name: str) -> float:
    """Llama-style scale: output projections of each block scaled down with depth."""
    if name.endswith(("wo.weight", "w2.weight")):
        return args.init_std / (2 * args.n_layers) ** 0.5
    return args.init_std


def unit_values(
    name: str, args: ModelArgs, spec: ParamSpec, units: Sequence[int], seed: int
) -> torch.Tensor:
    """The initial values of `units` of a sharded parameter, in the order given, laid out as
    the local tensor holding them (split dimension `spec.dim`)."""
    shape = args.shape()
    size = unit_size(shape, spec.kind)
    rest = [n for i, n in enumerate(parameter_shapes(args)[name]) if i != spec.dim]
    per_unit = size * math.prod(rest)
    block = max(1, BLOCK_ELEMENTS // per_unit)
    out = torch.empty(len(units) * size, *rest)
    std = _std(args, name)
    by_block: dict[int, list[tuple[int, int]]] = {}
    for i, u in enumerate(units):
        by_block.setdefault(u // block, []).append((i, u % block))
    for b, members in by_block.items():
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{b}".encode()))
        values = torch.randn(block * size, *rest, generator=gen) * std
        for i, j in members:
            out[i * size : (i + 1) * size] = values[j * size : (j + 1) * size]
    return out.movedim(0, spec.dim)


def init_parameters(
    model: nn.Module, args: ModelArgs, shard: RankShard | None, seed: int
) -> None:
    """Fill every parameter with its initial values: norm gains 1, biases 0, each sharded weight
    with the values of the units `shard` holds (all of them when `shard` is None: the dense
    model)."""
    shape = args.shape()
    with torch.no_grad():
        for name, p in model.named_parameters():
            spec = spec_of(name)
            if spec is None:
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):
                p.zero_()
                continue
            units = range(shape.unit_count(spec.kind)) if shard is None else shard.units(spec.kind)
            p.copy_(unit_values(name, args, spec, list(units), seed))


def _replace_parameters(
    model: nn.Module, make: Callable[[str, nn.Parameter], nn.Parameter]
) -> None:
    """Give every module `make(name, parameter)` in place of each of its parameters. A parameter
    two modules share (a tied LM head) is made once and stays one."""
    names = {id(p): name for name, p in model.named_parameters()}
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = make(names[id(p)], p)
                module._parameters[key] = made[id(p)]


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate (uninitialized) every parameter still on the meta device on `device`, and move
    the buffers there."""
    _replace_parameters(model, lambda _name, p: p if not p.is_meta else nn.Parameter(
        torch.empty_like(p, device=device), requires_grad=p.requires_grad))
    model.to(device)


def adopt(model: nn.Module, weights: Mapping[str, torch.Tensor], device: torch.device | str
          ) -> None:
    """Make the given tensors (a relayout's moved weights) the model's parameters, as they are:
    nothing is allocated or copied; move the buffers to `device`."""
    _replace_parameters(model, lambda name, p: nn.Parameter(
        weights[name], requires_grad=p.requires_grad))
    model.to(device)


def dense_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """The whole model with the seeded initial weights (for references and tools; a training
    rank never builds it)."""
    model = Transformer(args)
    init_parameters(model, args, None, seed)
    return model
