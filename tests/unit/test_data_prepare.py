"""``dataset.prepare``: inputs of every kind to tokens.bin + meta.json, byte for byte.

Expected tokens are computed independently with the tokenizer itself
(``encode(doc).ids + [eod]`` per document, in input order) and compared with the
file on disk; resuming, refusing to overwrite and every input error are checked
through the same public ``prepare`` entry point.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from autohet_cli.dataset import DataError
from autohet_cli.dataset.prepare import (
    FORMAT,
    PrepareOptions,
    PrepareResult,
    file_sha256,
    partial_dir,
    prepare,
    sample_dir,
)
from autohet_cli.dataset.readers import DocSeparator, read_documents

SAMPLE_TOKENIZER = sample_dir() / "tokenizer.json"
DOCS_A = ["In the beginning was the word.", "Naïve café — 東京, emoji 🙂 too."]
DOCS_B = ["And the earth was without form,\nand void.", "Second jsonl doc."]
DOCS_C = ["Gzipped one.", "Gzipped two", "Gzipped three\n"]
DOCS_D = ["Parquet row one.", "Parquet row two."]


@pytest.fixture(scope="module")
def sample_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(SAMPLE_TOKENIZER))


def _expected(tokenizer: Tokenizer, docs: list[str], eod: int = 0) -> list[int]:
    return [i for doc in docs for i in [*tokenizer.encode(doc).ids, eod]]


def _tokens(out: Path, dtype: str = "<u2") -> list[int]:
    return np.fromfile(out / "tokens.bin", dtype=dtype).tolist()


def _jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _run(*inputs: Path, out: Path, **kwargs: object) -> PrepareResult:
    options = PrepareOptions(inputs=inputs, tokenizer="sample", out_dir=out, **kwargs)  # type: ignore[arg-type]
    return prepare(options)


def _mixed_inputs(tmp_path: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = tmp_path / "a.txt"
    a.write_text(DOCS_A[0] + "\n\n" + DOCS_A[1] + "\n", encoding="utf-8")
    b = _jsonl(tmp_path / "b.jsonl", DOCS_B)
    c = tmp_path / "c.jsonl.gz"
    with gzip.open(c, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in DOCS_C) + "\n")
    d = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": DOCS_D, "n": [1, 2]}), d)
    return [a, b, c, d]


def test_every_input_kind_gives_the_tokenizers_ids_then_eod(
    tmp_path: Path, sample_tokenizer: Tokenizer
) -> None:
    inputs = _mixed_inputs(tmp_path)
    out = tmp_path / "out"
    result = _run(*inputs, out=out, doc_separator=DocSeparator.BLANK_LINE, num_workers=1)
    per_input = [DOCS_A, DOCS_B, DOCS_C, DOCS_D]
    expected = [_expected(sample_tokenizer, docs) for docs in per_input]
    assert _tokens(out) == [i for ids in expected for i in ids]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == FORMAT == "autohet.tokens/v1"
    assert (meta["dtype"], meta["vocab_size"], meta["eod_id"]) == ("uint16", 2048, 0)
    assert meta["num_tokens"] == sum(map(len, expected)) == result.num_tokens
    assert meta["num_documents"] == 9 == result.num_documents
    assert meta["tokenizer"] == {
        "path": str(SAMPLE_TOKENIZER),
        "sha256": file_sha256(SAMPLE_TOKENIZER),
    }
    assert meta["created_by"] == "autohet data prepare"
    rows = [
        {
            "path": str(path),
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
            "documents": len(docs),
            "tokens": len(ids),
        }
        for path, docs, ids in zip(inputs, per_input, expected, strict=True)
    ]
    assert meta["inputs"] == rows
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokens.bin"]
    assert not partial_dir(out).exists()
    decoded = sample_tokenizer.decode(_tokens(out)[: len(expected[0])], skip_special_tokens=True)
    assert decoded == "".join(DOCS_A)  # UTF-8 beyond ASCII survives the byte-level BPE


def test_a_txt_file_is_one_document_unless_split_on_blank_lines(
    tmp_path: Path, sample_tokenizer: Tokenizer
) -> None:
    text = "first para\nline two\n\n\n  \nsecond para\n"
    (tmp_path / "t.txt").write_text(text)
    _run(tmp_path / "t.txt", out=tmp_path / "whole")
    assert _tokens(tmp_path / "whole") == _expected(sample_tokenizer, [text])
    _run(tmp_path / "t.txt", out=tmp_path / "split", doc_separator=DocSeparator.BLANK_LINE)
    expected = _expected(sample_tokenizer, ["first para\nline two", "second para"])
    assert _tokens(tmp_path / "split") == expected


def test_directories_expand_to_their_inputs_sorted(
    tmp_path: Path, sample_tokenizer: Tokenizer
) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / ".hidden").mkdir()
    (data / "b.txt").write_text("bee")
    (data / "sub" / "c.txt").write_text("sea")
    (data / "a.txt").write_text("ay")
    (data / ".hidden" / "x.txt").write_text("hidden")
    (data / "README.md").write_text("not an input")
    result = _run(data, out=tmp_path / "out")
    assert [Path(row["path"]).name for row in result.meta["inputs"]] == ["a.txt", "b.txt", "c.txt"]
    assert _tokens(tmp_path / "out") == _expected(sample_tokenizer, ["ay", "bee", "sea"])


def test_output_does_not_depend_on_the_number_of_workers(tmp_path: Path) -> None:
    inputs = []
    for n in range(3):
        docs = [f"Document {n}.{k}: " + "and it was so. " * (k % 7 + 1) for k in range(60)]
        inputs.append(_jsonl(tmp_path / f"part{n}.jsonl", docs))
    one = _run(*inputs, out=tmp_path / "one", num_workers=1, chunk_chars=500)
    two = _run(*inputs, out=tmp_path / "two", num_workers=2, chunk_chars=500)
    assert (tmp_path / "one" / "tokens.bin").read_bytes() == (
        tmp_path / "two" / "tokens.bin"
    ).read_bytes()
    assert one.meta == two.meta
    assert one.num_documents == 180


def test_an_interrupted_run_resumes_with_its_finished_inputs(tmp_path: Path) -> None:
    first = _jsonl(tmp_path / "first.jsonl", ["one", "two", "three"])
    second = _jsonl(tmp_path / "second.jsonl", ["four", "five"])
    out = tmp_path / "out"

    def interrupt_after_first_input(fraction: float, detail: str) -> None:
        if detail.startswith("second.jsonl"):
            raise KeyboardInterrupt

    options = PrepareOptions(inputs=(first, second), tokenizer="sample", out_dir=out)
    with pytest.raises(KeyboardInterrupt):
        prepare(options, interrupt_after_first_input)
    assert not out.exists()
    parts = partial_dir(out) / "parts"
    assert sorted(p.name for p in parts.glob("*.json")) == [f"{file_sha256(first)}.json"]

    resumed = prepare(options)
    fresh = _run(first, second, out=tmp_path / "fresh")
    assert (resumed.num_inputs_reused, fresh.num_inputs_reused) == (1, 0)
    assert resumed.num_tokens_tokenized == fresh.meta["inputs"][1]["tokens"]
    assert (out / "tokens.bin").read_bytes() == (tmp_path / "fresh" / "tokens.bin").read_bytes()
    assert resumed.meta == fresh.meta
    assert not partial_dir(out).exists()


def test_a_finished_part_is_really_reused_not_redone(tmp_path: Path) -> None:
    doc = _jsonl(tmp_path / "doc.jsonl", ["hello"])
    out = tmp_path / "out"
    options = PrepareOptions(inputs=(doc,), tokenizer="sample", out_dir=out)

    def stop_before_finishing(_fraction: float, detail: str) -> None:
        if detail.startswith("doc.jsonl"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(options, stop_before_finishing)
    parts = partial_dir(out) / "parts"
    sha = file_sha256(doc)
    assert not (parts / f"{sha}.json").exists()  # cut short before its done marker
    # Plant a finished part with other (well-formed) tokens and the marker prepare would
    # write for them (their hash, the whole input): a resume must take it as is.
    tokens = np.array([7, 8, 9], dtype="<u2").tobytes()
    (parts / f"{sha}.bin").write_bytes(tokens)
    marker = {
        "input": {"sha256": sha, "start": 0, "end": doc.stat().st_size},
        "part_sha256": hashlib.sha256(tokens).hexdigest(),
        "documents": 1,
        "tokens": 3,
    }
    (parts / f"{sha}.json").write_text(json.dumps(marker))
    result = prepare(options)
    assert (result.num_inputs_reused, result.redone) == (1, ())
    assert _tokens(out) == [7, 8, 9]


def test_a_partial_run_under_other_settings_is_refused(tmp_path: Path) -> None:
    first = _jsonl(tmp_path / "first.jsonl", ["one"])
    second = _jsonl(tmp_path / "second.jsonl", ["two"])
    out = tmp_path / "out"

    def stop(_fraction: float, detail: str) -> None:
        if detail.startswith("second"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareOptions(inputs=(first, second), tokenizer="sample", out_dir=out), stop)
    bang = Tokenizer.from_file(str(SAMPLE_TOKENIZER)).token_to_id("!")
    with pytest.raises(DataError, match=rf"other settings \(eod_id: was 0, now {bang}\).*delete"):
        _run(first, second, out=out, eod_token="!")
    assert not out.exists() and partial_dir(out).exists()


def test_existing_out_dir_is_an_error_and_left_alone(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "a.jsonl", ["x"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match=r"--out .*out already exists.*another --out or delete"):
        _run(src, out=out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not partial_dir(out).exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl:3: not a JSON object"),
        ('{"body": "x"}', r"bad\.jsonl:3: no 'text' field \(found: body\); pass --text-key"),
        ('{"text": 5}', r"bad\.jsonl:3: field 'text' is int, not a string"),
    ],
)
def test_a_bad_jsonl_line_is_named_by_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        _run(bad, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not partial_dir(tmp_path / "out").exists()  # nothing finished: nothing to keep


def test_text_key_names_the_field(tmp_path: Path, sample_tokenizer: Tokenizer) -> None:
    src = _jsonl(tmp_path / "a.jsonl", ["body text"], key="content")
    _run(src, out=tmp_path / "out", text_key="content")
    assert _tokens(tmp_path / "out") == _expected(sample_tokenizer, ["body text"])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("notes.csv", r"notes\.csv: unsupported input; supported kinds are \.txt"),
        ("missing.txt", r"missing\.txt: no such input"),
        ("empty_dir", r"empty_dir: a directory with no input files"),
    ],
)
def test_unusable_inputs_are_named(tmp_path: Path, name: str, message: str) -> None:
    (tmp_path / "notes.csv").write_text("a,b\n")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=message):
        _run(tmp_path / name, out=tmp_path / "out")


def test_no_inputs_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no inputs"):
        _run(out=tmp_path / "out")


def test_parquet_without_pyarrow_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs pyarrow: pip install 'autohet-cli\[parquet\]'"):
        _run(tmp_path / "d.parquet", out=tmp_path / "out")


def _wordlevel(path: Path, words: list[str]) -> Path:
    vocab = {word: i for i, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def test_tokenizer_errors(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "a.jsonl", ["x"])
    out = tmp_path / "out"

    def run(tokenizer: str, eod: str | None = None) -> None:
        prepare(PrepareOptions(inputs=(src,), tokenizer=tokenizer, out_dir=out, eod_token=eod))

    with pytest.raises(DataError, match=r"--tokenizer .*nope\.json: no such file"):
        run(str(tmp_path / "nope.json"))
    with pytest.raises(DataError, match=r"the directory has no tokenizer\.json"):
        run(str(tmp_path))
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(DataError, match=r"broken\.json: not a tokenizer\.json"):
        run(str(tmp_path / "broken.json"))
    plain = str(_wordlevel(tmp_path / "plain.json", ["[UNK]", "x", "<end>"]))
    with pytest.raises(DataError, match=r"none of <\|endoftext\|>, </s>.* pass --eod-token"):
        run(plain)
    with pytest.raises(DataError, match=r"--eod-token '<stop>' is not in the vocabulary"):
        run(plain, "<stop>")
    run(plain, "<end>")
    assert _tokens(out) == [1, 2]
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_a_directory_holding_tokenizer_json_and_uint32_for_big_vocabularies(
    tmp_path: Path,
) -> None:
    words = ["[UNK]", "</s>", *(f"w{i}" for i in range(70_000))]
    (tmp_path / "tok").mkdir()
    _wordlevel(tmp_path / "tok" / "tokenizer.json", words)
    src = tmp_path / "a.txt"
    src.write_text("w0 w69999 unknown")
    options = PrepareOptions(inputs=(src,), tokenizer=str(tmp_path / "tok"), out_dir=tmp_path / "o")
    meta = prepare(options).meta
    assert (meta["dtype"], meta["vocab_size"], meta["eod_id"]) == ("uint32", 70_002, 1)
    assert _tokens(tmp_path / "o", "<u4") == [2, 70_001, 0, 1]


def test_the_shipped_sample(sample_tokenizer: Tokenizer) -> None:
    assert sample_tokenizer.get_vocab_size() == 2048
    assert sample_tokenizer.token_to_id("<|endoftext|>") == 0
    line = "And God said, Let there be light: and there was light. Ça va? 東京"
    assert sample_tokenizer.decode(sample_tokenizer.encode(line).ids) == line
    corpus = sample_dir() / "corpus.txt"
    assert corpus.stat().st_size > 500_000
    total = sum(p.stat().st_size for p in sample_dir().iterdir())
    assert total < 2_100_000
    # corpus.jsonl holds the same chapters that corpus.txt separates by blank lines.
    txt = read_documents(corpus, text_key="text", doc_separator=DocSeparator.BLANK_LINE)
    jsonl = read_documents(
        sample_dir() / "corpus.jsonl", text_key="text", doc_separator=DocSeparator.NONE
    )
    chapters = [doc for doc, _ in txt]
    assert len(chapters) > 250
    assert chapters == [doc for doc, _ in jsonl]
    assert chapters[0].startswith("In the beginning God created the heaven and the earth.\n")


def test_special_token_text_inside_a_document_is_text_not_a_document_end(tmp_path: Path) -> None:
    import json as _json

    import numpy as np

    from tests.cli import autohet

    src = tmp_path / "a.txt"
    src.write_text("hello <|endoftext|> world")
    res = autohet(
        "data",
        "prepare",
        str(src),
        "--tokenizer",
        "sample",
        "--out",
        str(tmp_path / "o"),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    meta = _json.loads((tmp_path / "o" / "meta.json").read_text())
    ids = np.fromfile(tmp_path / "o" / "tokens.bin", dtype=np.uint16)
    assert list(ids).count(meta["eod_id"]) == 1 and ids[-1] == meta["eod_id"]
