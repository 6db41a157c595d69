"""``data prepare`` under hostile inputs: huge documents, lines without end, a killed
worker, damaged parquet pages and a dangling ``--out`` symlink (issue 29, medium 4-5).

Long documents are tokenized in pieces cut before a space; for a byte-level BPE
(the shipped sample, GPT-2's family) such a cut changes no token, so the expected ids
are still ``encode(document).ids + [eod]``, computed by the tokenizer itself.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from autohet_cli.dataset import DataError, WorkerDied
from autohet_cli.dataset.pieces import cut_pieces
from autohet_cli.dataset.prepare import PrepareOptions, PrepareResult, partial_dir, prepare
from autohet_cli.dataset.readers import DocSeparator, read_documents
from tests.cli import ROOT, autohet

SAMPLE = Tokenizer.from_file(str(ROOT / "autohet_cli" / "data" / "sample" / "tokenizer.json"))
CORPUS = (ROOT / "autohet_cli" / "data" / "sample" / "corpus.txt").read_text(encoding="utf-8")


def _run(*inputs: Path, out: Path, **kwargs: object) -> PrepareResult:
    options = PrepareOptions(inputs=inputs, tokenizer="sample", out_dir=out, **kwargs)  # type: ignore[arg-type]
    return prepare(options)


def _tokens(out: Path) -> list[int]:
    return np.fromfile(out / "tokens.bin", dtype="<u2").tolist()


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


# ------------------------------------------------------------------ huge documents

# The peak resident memory of a fresh process (VmHWM: unlike ru_maxrss, it does not
# start from the parent's size), before and after preparing, in MiB.
MEASURE = """
import sys
from pathlib import Path
from autohet_cli.dataset.prepare import PrepareOptions, prepare
def peak_mib():
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) // 1024
options = PrepareOptions(
    inputs=(Path(sys.argv[1]),), tokenizer="sample", out_dir=Path(sys.argv[2]),
    num_workers=1, chunk_chars=1 << 16, piece_chars=1 << 15,
)
before = peak_mib()
prepare(options)
print(peak_mib() - before)
"""


def test_one_huge_line_is_tokenized_in_bounded_memory(tmp_path: Path) -> None:
    # 1.5 M characters on one line: encoded whole, the tokenizer holds ~170 bytes a
    # character (~250 MB); in 32 K-character pieces, a few tens of MB at most.
    doc = (CORPUS.replace("\n", " ") * 3)[: 3 << 19]
    src = _jsonl(tmp_path / "huge.jsonl", [doc])
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(src), str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    grown_mib = int(proc.stdout.split()[-1])
    assert grown_mib < 80, f"peak memory grew {grown_mib} MiB for a 1.5 MB document"
    tokens = _tokens(out)
    assert tokens.count(0) == 1 and tokens[-1] == 0
    assert SAMPLE.decode(tokens[:-1]) == doc


@pytest.mark.parametrize("kind", ["jsonl", "txt", "txt-blank-line", "parquet"])
def test_a_split_document_has_the_tokens_of_the_whole_one(tmp_path: Path, kind: str) -> None:
    doc = CORPUS[:40_000].strip()  # words, punctuation, newlines and blank lines
    if kind == "txt-blank-line":
        doc = doc.replace("\n\n", "\n")
    src = tmp_path / ("d.parquet" if kind == "parquet" else f"d.{kind.split('-')[0]}")
    if kind == "jsonl":
        _jsonl(src, [doc, "after"])
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [doc, "after"]}), src)
    else:
        src.write_text(doc + "\n\nafter", encoding="utf-8")
    separator = DocSeparator.BLANK_LINE if kind == "txt-blank-line" else DocSeparator.NONE
    result = _run(src, out=tmp_path / "out", piece_chars=1000, doc_separator=separator)
    docs = [doc + "\n\nafter"] if kind == "txt" else [doc, "after"]
    assert _tokens(tmp_path / "out") == [i for d in docs for i in [*SAMPLE.encode(d).ids, 0]]
    assert result.num_documents == len(docs)


def test_a_document_without_whitespace_is_cut_anywhere_and_loses_nothing(tmp_path: Path) -> None:
    doc = "東京abc🙂" * 3000
    src = _jsonl(tmp_path / "d.jsonl", [doc])
    _run(src, out=tmp_path / "out", piece_chars=999)
    tokens = _tokens(tmp_path / "out")
    assert tokens.count(0) == 1 and tokens[-1] == 0
    assert SAMPLE.decode(tokens[:-1]) == doc


def _templated(path: Path) -> Path:
    """A Llama-like tokenizer: its template wraps every encoded text in <s> ... </s>."""
    words = ["[UNK]", "<s>", "</s>", *(f"w{i}" for i in range(50))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer.save(str(path))
    return path


def test_a_template_wraps_a_split_document_once(tmp_path: Path) -> None:
    tok = _templated(tmp_path / "tok.json")
    doc = " ".join(f"w{i % 50}" for i in range(3000))
    src = _jsonl(tmp_path / "d.jsonl", [doc, "w7 w8"])
    options = PrepareOptions(
        inputs=(src,), tokenizer=str(tok), out_dir=tmp_path / "out", piece_chars=500
    )
    prepare(options)
    whole = Tokenizer.from_file(str(tok))
    # The template already ends each document with </s> (the end-of-document id): no
    # second one, and <s> only at each document's start, not at each piece's.
    assert _tokens(tmp_path / "out") == whole.encode(doc).ids + whole.encode("w7 w8").ids
    assert _tokens(tmp_path / "out").count(1) == 2


def test_a_jsonl_line_longer_than_the_cap_is_refused_by_file_and_line(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "d.jsonl", ["short", "x" * 980, "y" * 2000])
    with pytest.raises(DataError, match=r"d\.jsonl:3: a line longer than 1,000 characters"):
        _run(src, out=tmp_path / "out", max_line_chars=1000)
    assert not partial_dir(tmp_path / "out").exists()


def test_a_blank_start_of_a_line_is_held_only_up_to_the_cap(tmp_path: Path) -> None:
    # Whether a line is blank (a paragraph break) is known only at its first
    # non-space: up to then its whitespace is held, and only up to the cap.
    (tmp_path / "t.txt").write_text("one\n" + " " * 1500 + "two\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"t\.txt:2: a line starts with more than 1,000 white"):
        _run(
            tmp_path / "t.txt", out=tmp_path / "out", doc_separator=DocSeparator.BLANK_LINE,
            piece_chars=100, max_line_chars=1000,
        )  # fmt: skip


def test_a_txt_file_without_newlines_is_read_in_pieces(tmp_path: Path) -> None:
    doc = CORPUS[:30_000].replace("\n", " ").strip()
    (tmp_path / "d.txt").write_text(doc, encoding="utf-8")
    for separator in DocSeparator:
        out = tmp_path / f"out-{separator.value}"
        _run(
            tmp_path / "d.txt", out=out, doc_separator=separator,
            piece_chars=700, max_line_chars=1000,
        )  # fmt: skip
        assert _tokens(out) == [*SAMPLE.encode(doc).ids, 0]


@pytest.mark.parametrize("seed", range(4))
def test_pieces_are_bounded_and_give_the_document_back(seed: int) -> None:
    rng = np.random.default_rng(seed)
    alphabet = list("ab c\n\t東🙂  ")
    text = "".join(rng.choice(alphabet, size=5000))
    fragments = [(text[i : i + 333], False, i) for i in range(0, len(text), 333)]
    pieces = list(cut_pieces([*fragments, ("", True, len(text))], 200))
    assert "".join(piece.text for piece in pieces) == text
    assert all(100 <= len(piece.text) <= 200 for piece in pieces[:-1])
    assert 0 < len(pieces[-1].text) <= 200
    assert [(p.starts_document, p.ends_document) for p in (pieces[0], pieces[-1])] == [
        (True, False),
        (False, True),
    ]
    # A cut falls before whitespace wherever the text has some in the window.
    assert all(piece.text[0].isspace() for piece in pieces[1:])


def _paragraphs_as_before(text: str) -> list[str]:
    """The blank-line rule, line by line: runs of non-blank lines joined by newlines."""
    docs, run = [], []
    for line in text.splitlines(keepends=True):
        if line.strip():
            run.append(line.rstrip("\n"))
        elif run:
            docs.append("\n".join(run))
            run = []
    return [*docs, "\n".join(run)] if run else docs


@pytest.mark.parametrize("piece_chars", [1, 2, 3, 7, 1 << 20])
def test_streamed_reading_keeps_every_document_whole(tmp_path: Path, piece_chars: int) -> None:
    text = "  \n\n one two\n  three\t\n\n\t \n four  \n\n\nfive six seven" + " eight" * 30 + "\n \n"
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    for separator, expected in [
        (DocSeparator.NONE, [text]),
        (DocSeparator.BLANK_LINE, _paragraphs_as_before(text)),
    ]:
        found = read_documents(
            tmp_path / "t.txt", text_key="text", doc_separator=separator, piece_chars=piece_chars
        )
        assert [doc for doc, _ in found] == expected


# ------------------------------------------------------------------ a killed worker


def test_a_killed_worker_is_a_clear_error_naming_the_input(tmp_path: Path) -> None:
    docs = [f"Document {k}: " + "and it was so. " * 6 for k in range(1500)]
    src = _jsonl(tmp_path / "many.jsonl", docs)
    out = tmp_path / "out"
    killed: list[int] = []

    def kill_a_worker(_fraction: float, detail: str) -> None:
        if not killed and detail.startswith("many.jsonl"):
            worker = multiprocessing.active_children()[0]
            os.kill(worker.pid or 0, signal.SIGKILL)
            killed.append(worker.pid or 0)

    options = PrepareOptions(
        inputs=(src,), tokenizer="sample", out_dir=out, num_workers=2, chunk_chars=200
    )
    with pytest.raises(WorkerDied) as caught:
        prepare(options, kill_a_worker)
    message = str(caught.value)
    assert "tokenizer worker process died" in message
    assert "SIGKILL" in message and "out of memory" in message
    assert str(src) in message and "fewer --workers" in message
    assert not out.exists() and partial_dir(out).exists()  # kept to resume from
    assert _run(src, out=out, num_workers=1).num_documents == len(docs)


# ------------------------------------------------------------------ damaged files, bad --out


def _damaged_parquet(path: Path, compression: str, dictionary: bool, where: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [f"row {i} " + "words here " * 20 for i in range(200)]
    table = pa.table({"text": rows})
    pq.write_table(
        table, path, row_group_size=100, compression=compression, use_dictionary=dictionary
    )
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    at = start if where == "header" else start + column.total_compressed_size // 2
    raw = bytearray(path.read_bytes())
    raw[at : at + 64] = b"\xff" * 64
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize(
    ("compression", "dictionary", "where"),
    [
        ("none", False, "data"),  # ArrowInvalid: truncated PLAIN data
        ("none", True, "data"),  # bytes that are not UTF-8
        ("snappy", False, "data"),  # OSError: corrupt snappy data
        ("snappy", True, "header"),  # OSError: page header not thrift
    ],
)
def test_a_damaged_parquet_page_names_the_file_and_row_group(
    tmp_path: Path, compression: str, dictionary: bool, where: str
) -> None:
    src = _damaged_parquet(tmp_path / "bad.parquet", compression, dictionary, where)
    with pytest.raises(DataError, match=r"bad\.parquet: row group 1 \(rows 101-200\) is damaged"):
        _run(src, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_out_as_a_dangling_symlink_is_refused_and_left_alone(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "a.jsonl", ["x"])
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"--out .*out is a symbolic link \(to .*nowhere\)"):
        _run(src, out=link)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()
    assert not partial_dir(link).exists()


def test_a_symlink_where_the_partial_dir_goes_is_refused(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "a.jsonl", ["x"])
    (tmp_path / "elsewhere").mkdir()
    partial_dir(tmp_path / "out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DataError, match=r"out\.partial is a symbolic link"):
        _run(src, out=tmp_path / "out")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_the_command_prints_one_line_for_a_dangling_out(tmp_path: Path) -> None:
    _jsonl(tmp_path / "a.jsonl", ["x"])
    (tmp_path / "out").symlink_to("missing-dir")
    res = autohet(
        "data", "prepare", "a.jsonl", "--tokenizer", "sample", "--out", "out", cwd=tmp_path
    )
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("error: --out out is a symbolic link"), res.stderr
    assert "Traceback" not in res.stderr
