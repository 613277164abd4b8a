"""`python -m ntp.prepare`: tokenize a corpus into token shards the trainer reads (docs/data.md).

The writer owns the dataset format: the file names, the index fields and their version are defined
here and read by `ntp.dataset`. Errors are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import sysconfig
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FORMAT_VERSION = 1
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
SHARD_NAME = "tokens-{:05d}.bin"
# what a prepare writes into its directory (a half-prepared one holds some of these, no INDEX)
OWN_FILE = re.compile(r"tokens-\d{5}\.bin|tokenizer\.json|index\.json(\.tmp)?")
# token dtype -> (array typecode, bytes per token); shards are little-endian
DTYPES = {"uint16": ("H", 2), "uint32": ("I", 4)}
DEFAULT_EOS = "<|endoftext|>"
DEFAULT_SHARD_TOKENS = 100_000_000
SUFFIX_FORMATS = {
    ".txt": "text", ".text": "text", ".md": "text", ".py": "text",
    ".jsonl": "jsonl", ".parquet": "parquet",
}
FORMATS = ("text", "jsonl", "parquet")
ENCODE_BATCH_CHARS = 1 << 20  # documents encoded together (the library spreads a batch on threads)


class PrepareError(ValueError):
    """The corpus cannot be prepared as asked; the one-line message says why."""


@dataclass(frozen=True)
class Source:
    path: Path
    format: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "bytes": self.path.stat().st_size, "format": self.format}


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def files_under(root: Path) -> list[Path]:
    """Every non-hidden file below `root`, sorted by relative path (the same order everywhere)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def find_sources(inputs: Iterable[Path], fmt: str | None) -> list[Source]:
    """Input files in command-line order, each directory's files sorted, with their format."""
    sources = []
    for given in inputs:
        if given.is_dir():
            files = files_under(given)
        elif given.is_file():
            files = [given]
        else:
            raise PrepareError(f"input {given} does not exist")
        for path in files:
            kind = fmt or SUFFIX_FORMATS.get(path.suffix.lower())
            if kind is None:
                raise PrepareError(
                    f"unknown format of {path} (suffix {path.suffix or 'none'!r}): pass "
                    f"--format {'|'.join(FORMATS)}"
                )
            sources.append(Source(path.resolve(), kind))
    if not sources:
        raise PrepareError("no input files: pass files or directories, or --stdlib")
    return sources


def stdlib_sources(max_bytes: int | None) -> list[Source]:
    """The running interpreter's standard library `.py` files (site-packages excluded), sorted;
    with `max_bytes`, the longest prefix of that list within it. The few files that are not UTF-8
    (test data in other encodings) are left out."""
    root = Path(sysconfig.get_path("stdlib"))
    sources, total = [], 0
    for path in files_under(root):
        parts = path.relative_to(root).parts
        if path.suffix != ".py" or "site-packages" in parts or "dist-packages" in parts:
            continue
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if max_bytes is not None and total + len(data) > max_bytes:
            break
        total += len(data)
        sources.append(Source(path, "text"))
    if not sources:
        raise PrepareError(f"no standard library file fits in --max-bytes {max_bytes} "
                           f"(the first is larger)")
    return sources


def documents(source: Source, field: str) -> Iterator[str]:
    """The documents of one input file: a text file is one document, a JSONL line or a Parquet
    row one each."""
    path = source.path
    try:
        if source.format == "text":
            yield path.read_bytes().decode("utf-8")
        elif source.format == "jsonl":
            yield from _jsonl_documents(path, field)
        else:
            yield from _parquet_documents(path, field)
    except UnicodeDecodeError as exc:
        raise PrepareError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PrepareError(f"{path} line {number} is not JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or field not in record:
                raise PrepareError(f"{path} line {number} has no {field!r} field")
            if not isinstance(record[field], str):
                raise PrepareError(f"{path} line {number}: {field!r} is not a string")
            yield record[field]


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa  # noqa: PLC0415  only Parquet inputs need it
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise PrepareError(f"{path} is not a Parquet file ({exc})") from exc
    with table:
        schema = table.schema_arrow
        if field not in schema.names:
            raise PrepareError(f"{path} has no column {field!r} "
                               f"(columns: {', '.join(schema.names)})")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise PrepareError(f"{path}: column {field!r} holds {kind}, not strings")
        row = 0
        for batch in table.iter_batches(columns=[field]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    raise PrepareError(f"{path} row {row}: {field!r} is null")
                row += 1
                yield text


def all_documents(sources: list[Source], field: str) -> Iterator[str]:
    for source in sources:
        yield from documents(source, field)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int, eos: str) -> bytes:
    """A byte-level BPE trained on `texts`, as tokenizer.json bytes; the same bytes every time.

    Deterministic because nothing in it depends on thread or hash-map order: the alphabet is the
    256 byte symbols, sorted by code point; word and pair counts are integer sums (the same
    whatever order the threads add them in); a count tie between merges goes to the smaller pair
    of ids; the two options whose ids the trainer assigns in hash-map order (a continuing-subword
    prefix, an end-of-word suffix) and `limit_alphabet` (whose cut sorts equal counts unstably)
    are left unset; the file lists the vocabulary by id. (Checked: two trainings, in one process
    or two, give byte-identical files: tests/ntp/test_dataset.py.)
    """
    if vocab_size < 257:
        raise PrepareError(f"--train-tokenizer {vocab_size}: a byte-level BPE needs a vocabulary "
                           f"of at least 257 (256 bytes and the end-of-document token)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str().encode()


def read_tokenizer(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise PrepareError(f"tokenizer {path} does not exist") from exc
    except OSError as exc:
        raise PrepareError(f"tokenizer {path} cannot be read ({exc.strerror})") from exc


def default_eos(tokenizer_path: Path | None) -> str:
    """The eos token a Hugging Face model directory names beside its tokenizer.json, if any."""
    config = tokenizer_path.parent / "tokenizer_config.json" if tokenizer_path else None
    if config is None or not config.is_file():
        return DEFAULT_EOS
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return DEFAULT_EOS
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else DEFAULT_EOS


def load_tokenizer(data: bytes, name: str, eos: str) -> tuple[Tokenizer, int, int]:
    """The tokenizer, its vocabulary size (largest id + 1) and the eos id."""
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the library raises plain Exception; bytes that are not UTF-8 too
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PrepareError(f"{name} is not a tokenizer.json ({first})") from exc
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise PrepareError(f"tokenizer {name} has no token {eos!r}: pass --eos TOKEN")
    # The eos token appears only where a document ends: text that spells a special token is
    # encoded as text (docs/data.md).
    tokenizer.encode_special_tokens = True
    vocab = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return tokenizer, vocab, eos_id


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


class ShardWriter:
    """Appends tokens to `tokens-NNNNN.bin` files of at most `shard_tokens` tokens each."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int, eos_id: int) -> None:
        self.out, self.dtype, self.shard_tokens, self.eos_id = out, dtype, shard_tokens, eos_id
        self.pending = array(DTYPES[dtype][0])
        self.shards: list[dict[str, Any]] = []

    def add(self, ids: list[int]) -> None:
        self.pending.extend(ids)
        while len(self.pending) >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> None:
        if self.pending:
            self._flush(len(self.pending))

    def _flush(self, count: int) -> None:
        chunk = self.pending[:count]
        del self.pending[:count]
        if sys.byteorder != "little":
            chunk.byteswap()
        name = SHARD_NAME.format(len(self.shards))
        with (self.out / name).open("wb") as f:
            chunk.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        # documents that end in this shard (each ends with the only eos of its tokens)
        self.shards.append({"file": name, "tokens": count, "documents": chunk.count(self.eos_id)})


def claim(out: Path, sources: list[dict[str, Any]], recipe: dict[str, Any]) -> bool:
    """Make `out` ready for a new dataset; True when it already holds this very one."""
    index = out / INDEX
    if index.exists():
        try:
            held = json.loads(index.read_text())
            same = held.get("sources") == sources and held.get("recipe") == recipe
        except (OSError, ValueError, AttributeError) as exc:
            raise PrepareError(f"{index} is unreadable ({exc}): remove {out} or choose another "
                               f"--out") from exc
        if same:
            return True
        raise PrepareError(f"{out} already holds a different dataset: choose another --out or "
                           f"remove it")
    if out.exists():
        if not out.is_dir():
            raise PrepareError(f"--out {out} is a file, not a directory")
        foreign = [p.name for p in out.iterdir() if not OWN_FILE.fullmatch(p.name)]
        if foreign:
            raise PrepareError(f"{out} holds files that are not a dataset's ({foreign[0]}, ...): "
                               f"choose another --out")
        for stale in out.iterdir():  # a half-prepared dataset's files
            stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return False


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Written whole or not at all: a reader sees the old file, the new one, or none."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class Prepared:
    index: dict[str, Any]
    seconds: float
    reused: bool


def prepare(
    sources: list[Source],
    out: Path,
    *,
    field: str = "text",
    tokenizer: Path | None = None,
    train_vocab: int | None = None,
    eos: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> Prepared:
    """Tokenize `sources` into `out` (docs/data.md); INDEX is written last, so a directory
    without it was never completed."""
    t0 = time.perf_counter()
    # 1. what is asked, so a directory holding the same dataset is kept and another refused
    if (tokenizer is None) == (train_vocab is None):
        raise PrepareError("pass one of --tokenizer FILE and --train-tokenizer VOCAB_SIZE")
    if shard_tokens < 1:
        raise PrepareError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    eos = eos or default_eos(tokenizer)
    given = read_tokenizer(tokenizer) if tokenizer is not None else None
    recipe = {
        "field": field,
        "eos_token": eos,
        "shard_tokens": shard_tokens,
        "tokenizer": ({"train_vocab_size": train_vocab} if given is None
                      else {"sha256": hashlib.sha256(given).hexdigest()}),
    }
    listed = [s.to_dict() for s in sources]
    created = not out.exists()
    if claim(out, listed, recipe):
        return Prepared(json.loads((out / INDEX).read_text()), time.perf_counter() - t0, True)
    try:
        # 2. the tokenizer, given or trained on the inputs
        if given is not None:
            data = given
        else:  # train_vocab is set: one of the two is (step 1)
            data = train_tokenizer(all_documents(sources, field), train_vocab, eos)
        tok, vocab, eos_id = load_tokenizer(data, str(tokenizer or "the trained tokenizer"), eos)
        dtype = "uint16" if vocab <= 1 << 16 else "uint32"
        # 3. every document's tokens and its eos, in input order, into shards
        writer = ShardWriter(out, dtype, shard_tokens, eos_id)
        count = 0
        for batch in _batches(all_documents(sources, field)):
            for encoding in tok.encode_batch(batch, add_special_tokens=False):
                ids = encoding.ids
                if eos_id in ids:
                    raise PrepareError(f"document {count} encodes to the eos token {eos!r} "
                                       f"(id {eos_id}) inside its text")
                ids.append(eos_id)
                writer.add(ids)
                count += 1
        writer.close()
        if count == 0:
            raise PrepareError("the inputs hold no documents")
        # 4. the tokenizer, then the index
        (out / TOKENIZER).write_bytes(data)
        index = {
            "version": FORMAT_VERSION,
            "tokenizer_sha256": hashlib.sha256(data).hexdigest(),
            "vocab_size": vocab,
            "dtype": dtype,
            "eos_id": eos_id,
            "documents": count,
            "tokens": sum(s["tokens"] for s in writer.shards),
            "shards": writer.shards,
            "sources": listed,
            "recipe": recipe,
        }
        write_json(out / INDEX, index)
    except BaseException:
        for path in out.iterdir():
            if OWN_FILE.fullmatch(path.name):
                path.unlink()
        if created:
            out.rmdir()
        raise
    return Prepared(index, time.perf_counter() - t0, False)


def _batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= ENCODE_BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that raises PrepareError (one line) where it would print the usage and exit."""

    def error(self, message: str) -> NoReturn:
        raise PrepareError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ntp.prepare",
        description="Tokenize text, JSONL or Parquet files (or the Python standard library) into "
                    "the token shards the trainer reads (docs/data.md).",
        allow_abbrev=False,
    )
    p.add_argument("inputs", nargs="*", type=Path, metavar="INPUT",
                   help="files or directories (recursed, sorted)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the dataset directory")
    p.add_argument("--format", choices=FORMATS,
                   help="every input's format (default: by suffix: .txt .text .md .py text, "
                        ".jsonl, .parquet)")
    p.add_argument("--field", default="text", metavar="NAME",
                   help="the JSONL field or Parquet column (default: text)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", type=Path, metavar="FILE", help="a tokenizer.json")
    tok.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                     help="train a byte-level BPE of this vocabulary on the inputs")
    p.add_argument("--eos", metavar="TOKEN",
                   help=f"the end-of-document token (default: the eos_token of a "
                        f"tokenizer_config.json beside --tokenizer, else {DEFAULT_EOS})")
    p.add_argument("--stdlib", action="store_true",
                   help="the running interpreter's standard library .py files as the corpus")
    p.add_argument("--max-bytes", type=int, metavar="N",
                   help="with --stdlib: the sorted files' longest prefix of at most N bytes")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"tokens per shard file at most (default: {DEFAULT_SHARD_TOKENS:,})")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.stdlib and args.inputs:
            raise PrepareError("--stdlib takes no INPUT")
        if args.max_bytes is not None and not args.stdlib:
            raise PrepareError("--max-bytes needs --stdlib")
        sources = (stdlib_sources(args.max_bytes) if args.stdlib
                   else find_sources(args.inputs, args.format))
        done = prepare(sources, args.out, field=args.field, tokenizer=args.tokenizer,
                       train_vocab=args.train_tokenizer, eos=args.eos,
                       shard_tokens=args.shard_tokens)
    except (PrepareError, OSError) as exc:
        print(f"ntp.prepare: {exc}", file=sys.stderr)
        return 2
    index = done.index
    if done.reused:
        print(f"ntp.prepare: {args.out} already holds this dataset; nothing to do")
        return 0
    print(f"ntp.prepare: {args.out}: {index['documents']} documents, {index['tokens']} tokens "
          f"({index['dtype']}, vocabulary {index['vocab_size']}) in {len(index['shards'])} "
          f"shard(s), {done.seconds:.2f} s ({index['tokens'] / done.seconds:,.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
