"""The trainer's reader of a prepared dataset: fixed windows of the token stream in a seeded order.

Global sample k is window `order(epoch)[k % N]` of epoch `k // N` (N windows), so a step that
takes samples [s*G, (s+1)*G) sees the same global batch under every layout, and a run resumed at
step s continues exactly there (docs/data.md). With a held-out split of H windows, the last H
windows of the token stream are never trained on (N counts the others) and held-out sample k is
window `N + k % H`, in stream order. Shards are memory-mapped, never read whole.
"""

from __future__ import annotations

import hashlib
import json
import sys
from bisect import bisect_right
from pathlib import Path
from typing import Any

import torch

from ntp.prepare import DTYPES, FORMAT_VERSION, INDEX, OWN_FILE

TORCH_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
INDEX_FIELDS = ("tokenizer_sha256", "vocab_size", "dtype", "eos_id", "documents", "tokens",
                "shards")


class DatasetError(ValueError):
    """The dataset cannot be read as asked; the one-line message names the problem."""


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of an epoch's order: the first 8 bytes (little-endian) of
    sha256("{seed}:{epoch}"), so distinct (seed, epoch) pairs never share an order by
    arithmetic accident."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The windows of one epoch in the order they are served: a permutation of range(N)."""
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def _read_index(path: Path) -> dict[str, Any]:
    index_path = path / INDEX
    if not path.is_dir():
        raise DatasetError(f"no dataset at {path} (not a directory)")
    if not index_path.is_file():
        if any(OWN_FILE.fullmatch(p.name) for p in path.iterdir()):
            raise DatasetError(f"dataset {path} is half-prepared (no {INDEX}): run the prepare "
                               f"command again")
        raise DatasetError(f"no dataset at {path} (no {INDEX})")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{index_path} is unreadable ({exc})") from exc
    if not isinstance(index, dict):
        raise DatasetError(f"{index_path} is not a dataset index")
    if index.get("version") != FORMAT_VERSION:
        raise DatasetError(f"dataset {path} has format version {index.get('version')!r}, this "
                           f"trainer reads version {FORMAT_VERSION}")
    missing = [f for f in INDEX_FIELDS if f not in index]
    if missing:
        raise DatasetError(f"{index_path} lacks {', '.join(missing)}")
    if index["dtype"] not in TORCH_DTYPES:
        raise DatasetError(f"dataset {path} has token dtype {index['dtype']!r}, not one of "
                           f"{', '.join(TORCH_DTYPES)}")
    return index


def _map_shards(path: Path, index: dict[str, Any]) -> list[torch.Tensor]:
    """Each shard memory-mapped copy-on-write (the file is never written)."""
    if sys.byteorder != "little":
        raise DatasetError("token shards are little-endian; this machine is not")
    itemsize = DTYPES[index["dtype"]][1]
    shards = []
    for shard in index["shards"]:
        file = path / shard["file"]
        expected = shard["tokens"] * itemsize
        size = file.stat().st_size if file.is_file() else None
        if size != expected:
            held = "is missing" if size is None else f"holds {size} bytes"
            raise DatasetError(f"dataset {path}: shard {shard['file']} {held}, the index says "
                               f"{expected}")
        shards.append(torch.from_file(str(file), shared=False, size=shard["tokens"],
                                      dtype=TORCH_DTYPES[index["dtype"]]))
    if sum(len(s) for s in shards) != index["tokens"]:
        raise DatasetError(f"dataset {path}: its shards hold {sum(len(s) for s in shards)} "
                           f"tokens, the index says {index['tokens']}")
    return shards


class TokenDataset:
    """Windows of seq_len + 1 tokens, window i = tokens[i*seq_len : i*seq_len + seq_len + 1] of
    the documents' concatenated tokens, served endlessly in a seeded order per epoch."""

    def __init__(self, path: Path, index: dict[str, Any], shards: list[torch.Tensor],
                 seq_len: int, seed: int, held_out: int = 0) -> None:
        self.path, self.index, self.seq_len, self.seed = path, index, seq_len, seed
        self.held_out = held_out
        self._shards = shards
        self._starts = [0]
        for shard in shards:
            self._starts.append(self._starts[-1] + len(shard))
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order)

    @classmethod
    def open(cls, path: Path, seq_len: int, seed: int, vocab_size: int,
             tokenizer: Path | None = None, held_out: int = 0) -> TokenDataset:
        """The dataset at `path` for a model of `vocab_size` tokens and `seq_len` positions;
        with `tokenizer`, checked to be the one the dataset was prepared with; with `held_out`,
        its last windows kept apart for evaluation."""
        path = Path(path)
        index = _read_index(path)
        if index["vocab_size"] > vocab_size:
            raise DatasetError(f"dataset {path} has a vocabulary of {index['vocab_size']} tokens,"
                               f" the model's is {vocab_size}")
        if tokenizer is not None:
            try:
                sha = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
            except OSError as exc:
                raise DatasetError(f"tokenizer {tokenizer} cannot be read ({exc.strerror})"
                                   ) from exc
            if sha != index["tokenizer_sha256"]:
                raise DatasetError(f"tokenizer {tokenizer} (sha256 {sha[:12]}...) is not the one "
                                   f"dataset {path} was prepared with (sha256 "
                                   f"{index['tokenizer_sha256'][:12]}...)")
        if seq_len < 1:
            raise DatasetError(f"seq_len must be at least 1, got {seq_len}")
        windows = (index["tokens"] - 1) // seq_len
        if windows < 1:
            raise DatasetError(f"dataset {path} holds {index['tokens']} tokens, fewer than one "
                               f"window of {seq_len + 1}")
        if held_out < 0 or held_out >= windows:
            raise DatasetError(f"dataset {path} holds {windows} windows of {seq_len + 1} tokens: "
                               f"holding {held_out} out leaves none to train on")
        return cls(path, index, _map_shards(path, index), seq_len, seed, held_out)

    @property
    def num_samples(self) -> int:
        """N: windows per epoch (the held-out ones apart)."""
        return (self.tokens - 1) // self.seq_len - self.held_out

    @property
    def vocab_size(self) -> int:
        return self.index["vocab_size"]

    @property
    def tokens(self) -> int:
        return self.index["tokens"]

    @property
    def documents(self) -> int:
        return self.index["documents"]

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Global samples start .. start+count-1: (count, seq_len + 1) int64."""
        if start < 0 or count < 0:
            raise DatasetError(f"samples({start}, {count}): start and count must be >= 0")
        n, length = self.num_samples, self.seq_len
        rows = torch.empty((count, length + 1), dtype=torch.int64)
        for row, k in enumerate(range(start, start + count)):
            epoch, position = divmod(k, n)
            window = int(self._epoch_order(epoch)[position])
            rows[row] = self._span(window * length, window * length + length + 1)
        return rows

    def held_out_samples(self, start: int, count: int) -> torch.Tensor:
        """Held-out samples start .. start+count-1 (cycling through the split)."""
        if self.held_out == 0:
            raise DatasetError(f"dataset {self.path} is opened with no held-out windows")
        if start < 0 or count < 0:
            raise DatasetError(f"held_out_samples({start}, {count}): start and count must be >= 0")
        length = self.seq_len
        rows = torch.empty((count, length + 1), dtype=torch.int64)
        for row, k in enumerate(range(start, start + count)):
            window = self.num_samples + k % self.held_out
            rows[row] = self._span(window * length, window * length + length + 1)
        return rows

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.num_samples, self.seed, epoch))
        return self._order[1]

    def _span(self, lo: int, hi: int) -> torch.Tensor:
        """Tokens [lo, hi) of the stream, across shard boundaries."""
        parts = []
        s = bisect_right(self._starts, lo) - 1
        while lo < hi:
            base = self._starts[s]
            take = min(hi, self._starts[s + 1]) - lo
            parts.append(self._shards[s][lo - base : lo - base + take].to(torch.int64))
            lo += take
            s += 1
        return torch.cat(parts)
