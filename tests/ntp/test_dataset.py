"""Datasets: prepare text, JSONL, Parquet and the standard library into token shards; the reader
gives every layout the same global batch, resumes exactly and refuses what it cannot train on.

The references are outside the code under test: the tokenizers library (decoding the shards,
encoding the documents again), the shard files read with the stdlib's `array`, and the sample
order derived here from its description in docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
import sysconfig
from array import array
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

from ntp.dataset import DatasetError, TokenDataset
from ntp.prepare import main as prepare_main
from tessera_contracts.model_shape import ModelShape
from tessera_core.plan import plan_job

pytestmark = pytest.mark.data

VOCAB = 300  # trained: 256 bytes, the eos token, 43 merges
SEQ_LEN = 16
SHARD_TOKENS = 64  # several shards, windows and documents across their boundaries
EOS = "<|endoftext|>"
WORDS = ("the", "gradient", "replica", "tensor", "power", "node", "step", "héllo", "wörld",
         "naïve", "日本語", "🤗", "GPU", "sync", "batch")


def corpus() -> list[str]:
    """Documents with what a byte-level round trip must keep: non-ASCII, CRLF, tabs, leading and
    trailing spaces, an empty document and one that spells the eos token as text."""
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(24)]
    docs[3] = "  leading spaces\r\nand CRLF\tand a tab  "
    docs[5] = ""
    docs[8] = f"a document that spells {EOS} in its text"
    return docs


def write_inputs(root: Path, docs: list[str], fmt: str) -> Path:
    """The documents as one input of format `fmt` (a directory of text files, one JSONL file,
    one Parquet file in small row groups)."""
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "text":
        for i, doc in enumerate(docs):
            (root / f"doc-{i:02d}.txt").write_bytes(doc.encode())
        return root
    if fmt == "jsonl":
        path = root / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in
                                enumerate(docs)))
        return path
    path = root / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path,
                   row_group_size=5)
    return path


def prepare(inputs: list[str], out: Path, *options: str) -> None:
    argv = [*inputs, "--out", str(out), *options]
    assert prepare_main(argv) == 0, argv


def shard_tokens(out: Path) -> tuple[dict, list[list[int]]]:
    """The index and each shard's tokens, read with the stdlib as docs/data.md describes them."""
    index = json.loads((out / "index.json").read_text())
    typecode = {"uint16": "H", "uint32": "I"}[index["dtype"]]
    shards = []
    for shard in index["shards"]:
        tokens = array(typecode)
        tokens.frombytes((out / shard["file"]).read_bytes())
        shards.append(tokens.tolist())
    return index, shards


def encoder(out: Path) -> Tokenizer:
    """The dataset's tokenizer as the library loads it, encoding special-token text as text."""
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.encode_special_tokens = True
    return tok


def stream_of(docs: list[str], tok: Tokenizer, eos_id: int) -> list[int]:
    """The documents' tokens, each followed by the eos token, in order."""
    tokens: list[int] = []
    for doc in docs:
        tokens += tok.encode(doc, add_special_tokens=False).ids + [eos_id]
    return tokens


class DocumentedOrder:
    """Global sample k -> its window, as docs/data.md defines the order."""

    def __init__(self, stream: list[int], seq_len: int, seed: int, held_out: int = 0) -> None:
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.n = (len(stream) - 1) // seq_len - held_out
        self.perms: dict[int, list[int]] = {}

    def window(self, i: int) -> list[int]:
        return self.stream[i * self.seq_len : i * self.seq_len + self.seq_len + 1]

    def sample(self, k: int) -> list[int]:
        epoch, position = divmod(k, self.n)
        if epoch not in self.perms:
            digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            self.perms[epoch] = torch.randperm(self.n, generator=generator).tolist()
        return self.window(self.perms[epoch][position])


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return corpus()


@pytest.fixture(scope="module")
def text_input(tmp_path_factory, docs) -> Path:
    return write_inputs(tmp_path_factory.mktemp("text-input"), docs, "text")


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory, text_input) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "ds"
    prepare([str(text_input)], out, "--train-tokenizer", str(VOCAB),
            "--shard-tokens", str(SHARD_TOKENS))
    return out


@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet"])
def test_each_document_decodes_back_to_its_text(tmp_path, docs, fmt):
    inputs = write_inputs(tmp_path / "in", docs, fmt)
    out = tmp_path / "ds"
    prepare([str(inputs)], out, "--train-tokenizer", str(VOCAB),
            "--shard-tokens", str(SHARD_TOKENS))

    index, shards = shard_tokens(out)
    eos = index["eos_id"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.token_to_id(EOS) == eos
    assert index["tokenizer_sha256"] == hashlib.sha256(
        (out / "tokenizer.json").read_bytes()).hexdigest()
    # documents found through the index: the stream cut after each eos
    stream = [t for shard in shards for t in shard]
    found, start = [], 0
    for end in (i for i, t in enumerate(stream) if t == eos):
        found.append(stream[start:end])
        start = end + 1
    assert start == len(stream)  # the stream ends with the last document's eos
    assert [tok.decode(ids, skip_special_tokens=False) for ids in found] == docs
    assert stream == stream_of(docs, encoder(out), eos)

    assert index["documents"] == len(docs)
    assert index["tokens"] == len(stream)
    assert index["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) == VOCAB
    assert index["dtype"] == "uint16"
    assert len(shards) > 1
    for shard, tokens in zip(index["shards"], shards, strict=True):
        assert shard["tokens"] == len(tokens) <= SHARD_TOKENS
        assert shard["documents"] == tokens.count(eos)
    files = sorted(inputs.iterdir()) if inputs.is_dir() else [inputs]
    assert [(Path(s["path"]), s["bytes"]) for s in index["sources"]] == [
        (f.resolve(), f.stat().st_size) for f in files]


def test_the_trained_tokenizer_and_shards_are_the_same_in_another_process(
        tmp_path, text_input, dataset_dir):
    out = tmp_path / "again"
    subprocess.run(
        [sys.executable, "-m", "ntp.prepare", str(text_input), "--out", str(out),
         "--train-tokenizer", str(VOCAB), "--shard-tokens", str(SHARD_TOKENS)],
        check=True, capture_output=True, timeout=120)
    assert (out / "tokenizer.json").read_bytes() == (dataset_dir / "tokenizer.json").read_bytes()
    first, again = shard_tokens(dataset_dir), shard_tokens(out)
    assert again[1] == first[1]
    assert again[0]["tokenizer_sha256"] == first[0]["tokenizer_sha256"]
    # the same request into a directory that holds its dataset already changes nothing
    before = (out / "index.json").read_bytes()
    prepare([str(text_input)], out, "--train-tokenizer", str(VOCAB),
            "--shard-tokens", str(SHARD_TOKENS))
    assert (out / "index.json").read_bytes() == before
    # a half-prepared directory (an interrupted run: no index, a stray partial shard) is redone
    (out / "index.json").unlink()
    (out / "tokens-00999.bin").write_bytes(b"\0" * 6)
    prepare([str(text_input)], out, "--train-tokenizer", str(VOCAB),
            "--shard-tokens", str(SHARD_TOKENS))
    assert (out / "index.json").read_bytes() == before
    assert not (out / "tokens-00999.bin").exists()


def test_a_given_tokenizer_json_from_a_model_directory(tmp_path, text_input, dataset_dir):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(dataset_dir / "tokenizer.json", model / "tokenizer.json")
    # a Hugging Face model directory names its eos token beside tokenizer.json; this one names
    # the dataset's only special token, as an AddedToken object
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS}}))
    out = tmp_path / "ds"
    prepare([str(text_input)], out, "--tokenizer", str(model / "tokenizer.json"),
            "--shard-tokens", str(SHARD_TOKENS))
    assert shard_tokens(out)[1] == shard_tokens(dataset_dir)[1]
    assert (out / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()


def test_a_vocabulary_over_65536_tokens_is_stored_as_uint32(tmp_path, docs, dataset_dir):
    # the trained tokenizer grown to 70,001 ids: fillers no merge produces, and an eos token
    # whose id (70,000) does not fit in 16 bits
    spec = json.loads((dataset_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab.update({f"filler{i}": i for i in range(len(vocab), 70_000)})
    spec["added_tokens"].append({"id": 70_000, "content": "<|doc|>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": True})
    big = tmp_path / "tokenizer.json"
    big.write_text(json.dumps(spec))
    inputs = write_inputs(tmp_path / "in", docs, "jsonl")
    out = tmp_path / "ds"
    prepare([str(inputs)], out, "--tokenizer", str(big), "--eos", "<|doc|>")

    index, shards = shard_tokens(out)
    assert (index["dtype"], index["vocab_size"], index["eos_id"]) == ("uint32", 70_001, 70_000)
    stream = stream_of(docs, encoder(out), 70_000)
    assert shards == [stream]
    order = DocumentedOrder(stream, SEQ_LEN, SEED)
    data = TokenDataset.open(out, SEQ_LEN, SEED, 70_001, tokenizer=big)
    assert data.samples(0, 20).tolist() == [order.sample(k) for k in range(20)]


# (4,4) splits the batch evenly; (4,3) NTP in proportion to TP (8 + 6); (2,2,2) NTP-PW equally,
# 14 over 3 unevenly (5 + 5 + 4).
SHAPE = ModelShape(hidden=48, n_heads=12, n_kv_heads=4, ffn=40, vocab=512, n_layers=1,
                   seq_len=SEQ_LEN)
LAYOUTS = [((4, 4), "ntp"), ((4, 3), "ntp"), ((2, 2, 2), "ntp-pw")]
GLOBAL_BATCH = 14
SEED = 1234


def test_every_layout_sees_the_documented_global_batch(dataset_dir, docs):
    data = TokenDataset.open(dataset_dir, SEQ_LEN, SEED, SHAPE.vocab)
    index = json.loads((dataset_dir / "index.json").read_text())
    order = DocumentedOrder(stream_of(docs, encoder(dataset_dir), index["eos_id"]), SEQ_LEN, SEED)
    assert data.num_samples == order.n
    assert (data.tokens, data.documents, data.vocab_size) == (len(order.stream), len(docs), VOCAB)
    layouts = [plan_job(SHAPE, tp, GLOBAL_BATCH, mode) for tp, mode in LAYOUTS]
    assert [[r.local_batch for r in job.replicas] for job in layouts] == [[7, 7], [8, 6],
                                                                          [5, 5, 4]]
    steps = range(2 * order.n // GLOBAL_BATCH + 2)  # into the third epoch
    for step in steps:
        expected = torch.tensor(
            [order.sample(k) for k in range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)])
        assert torch.equal(data.samples(step * GLOBAL_BATCH, GLOBAL_BATCH), expected), step
        for job in layouts:
            # each replica reads its own slice, as the trainer's ranks do
            rows = [data.samples(step * GLOBAL_BATCH + r.batch_offset, r.local_batch)
                    for r in sorted(job.replicas, key=lambda r: r.batch_offset)]
            assert torch.equal(torch.cat(rows), expected), (step, job.tp_degrees)
    assert data.samples(0, 1).dtype == torch.int64


def test_a_reopened_reader_resumes_at_the_same_rows(dataset_dir):
    first = TokenDataset.open(dataset_dir, SEQ_LEN, SEED, SHAPE.vocab)
    seen = [first.samples(s * GLOBAL_BATCH, GLOBAL_BATCH) for s in range(12)]
    for step in (0, 5, 11):  # a restart at step s opens the dataset anew and reads step s first
        restarted = TokenDataset.open(dataset_dir, SEQ_LEN, SEED, SHAPE.vocab)
        assert torch.equal(restarted.samples(step * GLOBAL_BATCH, GLOBAL_BATCH), seen[step])
    other_seed = TokenDataset.open(dataset_dir, SEQ_LEN, SEED + 1, SHAPE.vocab)
    assert not torch.equal(other_seed.samples(0, GLOBAL_BATCH), seen[0])


def test_epochs_wrap_around_in_a_new_order(dataset_dir, docs):
    data = TokenDataset.open(dataset_dir, SEQ_LEN, SEED, SHAPE.vocab)
    n = data.num_samples
    index = json.loads((dataset_dir / "index.json").read_text())
    order = DocumentedOrder(stream_of(docs, encoder(dataset_dir), index["eos_id"]), SEQ_LEN, SEED)
    windows = sorted(order.window(i) for i in range(n))
    both = data.samples(0, 2 * n).tolist()
    epoch0, epoch1 = both[:n], both[n:]
    assert sorted(epoch0) == windows and sorted(epoch1) == windows  # every window once an epoch
    assert epoch0 != epoch1
    # a batch across the boundary is the end of one epoch and the start of the next
    assert data.samples(n - 3, 6).tolist() == epoch0[-3:] + epoch1[:3]


def test_held_out_windows_are_never_trained_on(dataset_dir, docs):
    index = json.loads((dataset_dir / "index.json").read_text())
    stream = stream_of(docs, encoder(dataset_dir), index["eos_id"])
    windows = (len(stream) - 1) // SEQ_LEN
    held = 3
    data = TokenDataset.open(dataset_dir, SEQ_LEN, SEED, SHAPE.vocab, held_out=held)
    order = DocumentedOrder(stream, SEQ_LEN, SEED, held_out=held)
    assert data.num_samples == windows - held
    # Training: every other window once an epoch, in the documented order, none held out.
    trained = data.samples(0, 2 * data.num_samples).tolist()
    assert trained == [order.sample(k) for k in range(2 * data.num_samples)]
    last = [order.window(i) for i in range(windows - held, windows)]
    assert not any(w in trained for w in last)
    # Held out: the stream's last windows in stream order, cycling.
    assert data.held_out_samples(0, held + 1).tolist() == last + last[:1]
    message = single_line_error(
        lambda: TokenDataset.open(dataset_dir, SEQ_LEN, SEED, SHAPE.vocab, held_out=windows))
    assert "leaves none to train on" in message
    unsplit = TokenDataset.open(dataset_dir, SEQ_LEN, SEED, SHAPE.vocab)
    assert "no held-out windows" in single_line_error(lambda: unsplit.held_out_samples(0, 1))


def single_line_error(call) -> str:
    with pytest.raises(DatasetError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_reader_refuses_what_it_cannot_train_on(tmp_path, dataset_dir):
    def open_(path: Path, vocab: int = SHAPE.vocab, tokenizer: Path | None = None) -> TokenDataset:
        return TokenDataset.open(path, SEQ_LEN, SEED, vocab, tokenizer=tokenizer)

    assert open_(dataset_dir, tokenizer=dataset_dir / "tokenizer.json").num_samples > 0
    message = single_line_error(lambda: open_(dataset_dir, vocab=VOCAB - 1))
    assert f"has a vocabulary of {VOCAB} tokens, the model's is {VOCAB - 1}" in message

    other = tmp_path / "tokenizer.json"
    other.write_text(json.dumps(json.loads((dataset_dir / "tokenizer.json").read_text()),
                                indent=4))
    message = single_line_error(lambda: open_(dataset_dir, tokenizer=other))
    assert "is not the one" in message and str(other) in message

    half = tmp_path / "half"
    shutil.copytree(dataset_dir, half)
    (half / "index.json").unlink()  # as a prepare stopped before its last write leaves it
    assert "half-prepared" in single_line_error(lambda: open_(half))

    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no index.json" in single_line_error(lambda: open_(empty))
    assert "no dataset" in single_line_error(lambda: open_(tmp_path / "absent"))

    truncated = tmp_path / "truncated"
    shutil.copytree(dataset_dir, truncated)
    with (truncated / "tokens-00001.bin").open("r+b") as f:
        f.truncate(10)
    assert "tokens-00001.bin holds 10 bytes" in single_line_error(lambda: open_(truncated))

    future = tmp_path / "future"
    shutil.copytree(dataset_dir, future)
    index = json.loads((future / "index.json").read_text())
    (future / "index.json").write_text(json.dumps({**index, "version": 99}))
    assert "format version 99" in single_line_error(lambda: open_(future))


def _bad_inputs(tmp: Path, dataset_dir: Path) -> dict[str, tuple[list[str], str]]:
    """Command lines (without --out) that prepare must refuse, and what the refusal says."""
    (tmp / "notes.xyz").write_text("x")
    (tmp / "nofield.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp / "latin1.txt").write_bytes("café".encode("latin-1"))
    pq.write_table(pa.table({"body": ["a"]}), tmp / "nocolumn.parquet")
    (tmp / "ok.txt").write_text("some text")
    trained = ["--train-tokenizer", str(VOCAB)]
    return {
        "no inputs": (trained, "no input files"),
        "a missing input": ([str(tmp / "absent.txt"), *trained], "does not exist"),
        "unknown format": ([str(tmp / "notes.xyz"), *trained], "unknown format"),
        "JSONL without the field": ([str(tmp / "nofield.jsonl"), *trained],
                                    "line 2 has no 'text' field"),
        "Parquet without the column": ([str(tmp / "nocolumn.parquet"), *trained],
                                       "has no column 'text'"),
        "not UTF-8": ([str(tmp / "latin1.txt"), *trained], "is not UTF-8"),
        "a missing tokenizer": ([str(tmp / "ok.txt"), "--tokenizer", str(tmp / "none.json")],
                                "does not exist"),
        "an eos the tokenizer lacks": ([str(tmp / "ok.txt"), "--tokenizer",
                                        str(dataset_dir / "tokenizer.json"), "--eos", "</s>"],
                                       "has no token '</s>'"),
        "a vocabulary below the bytes": ([str(tmp / "ok.txt"), "--train-tokenizer", "100"],
                                         "at least 257"),
        "no tokenizer": ([str(tmp / "ok.txt")], "--tokenizer"),
    }


def test_prepare_refuses_with_one_line_and_status_2(tmp_path, capsys, dataset_dir):
    cases = _bad_inputs(tmp_path, dataset_dir)
    for number, (name, (argv, says)) in enumerate(cases.items()):
        out = tmp_path / f"out-{number}"
        assert prepare_main([*argv, "--out", str(out)]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ntp.prepare: ") and says in err, (
            name, err)
        assert not out.exists(), name  # a refused prepare leaves nothing behind

    # a directory that holds another dataset is refused and left as it was
    before = (dataset_dir / "index.json").read_bytes()
    assert prepare_main([str(tmp_path / "ok.txt"), "--out", str(dataset_dir),
                         "--train-tokenizer", str(VOCAB)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a different dataset" in err
    assert (dataset_dir / "index.json").read_bytes() == before


def test_the_standard_library_is_a_corpus_without_a_download(tmp_path):
    budget = 100_000
    out = tmp_path / "stdlib"
    prepare([], out, "--stdlib", "--max-bytes", str(budget), "--train-tokenizer", "512")
    index, shards = shard_tokens(out)

    root = Path(sysconfig.get_path("stdlib"))
    listed = sorted((p for p in root.rglob("*.py") if "site-packages" not in p.parts),
                    key=lambda p: p.relative_to(root).as_posix())
    prefix, total = [], 0
    for path in listed:  # the longest prefix within the budget (no stdlib file this early is
        size = path.stat().st_size  # in another encoding than UTF-8)
        if total + size > budget:
            break
        prefix.append(path)
        total += size
    assert [Path(s["path"]) for s in index["sources"]] == prefix
    assert sum(s["bytes"] for s in index["sources"]) == total <= budget
    assert index["documents"] == len(prefix) > 1

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    stream = [t for shard in shards for t in shard]
    cuts = [-1] + [i for i, t in enumerate(stream) if t == index["eos_id"]]
    decoded = [tok.decode(stream[a + 1 : b], skip_special_tokens=False)
               for a, b in zip(cuts, cuts[1:], strict=False)]
    assert decoded == [p.read_bytes().decode("utf-8") for p in prefix]
    data = TokenDataset.open(out, 64, 0, 512)
    assert data.samples(0, 4).shape == (4, 65)
