"""Regenerate the sample corpus and tokenizer shipped in ``autohet_cli/data/sample/``.

The text is the King James Bible (1611, public domain) as the Debian package
``bible-kjv-text`` installs it, printed book by book with ``/usr/bin/bible``. The
output is byte-for-byte deterministic: books in a fixed order, verse references
stripped, one verse per line, and a byte-level BPE tokenizer trained on one thread,
so that the order of equal-count merges cannot depend on thread scheduling (two runs
with two threads also agreed, on tokenizers 0.23; one thread costs about a second).

Run from the repository root:

    python scripts/make_sample_corpus.py          # rewrite the files
    python scripts/make_sample_corpus.py --check  # fail if they would change
"""

from __future__ import annotations

import os

# Before tokenizers is imported: its rayon pool reads this once, when first used.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "autohet_cli" / "data" / "sample"
BIBLE = "/usr/bin/bible"
# Whole books, in canonical order: about 750 KB of verses, the size the brief asks for.
BOOKS = ("Genesis", "Exodus", "Ruth", "Esther", "Psalms", "Proverbs", "Ecclesiastes")
VOCAB_SIZE = 2048
EOD = "<|endoftext|>"
# ``bible -f`` prints one verse a line as ``Ge1:1 In the beginning ...``.
VERSE = re.compile(r"^(?P<book>[1-3]?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.+)$")


def read_book(name: str) -> list[list[str]]:
    """The chapters of one book, each a list of verse texts.

    ``bible`` clamps a range to the book, so ``1:1-999:999`` prints all of it."""
    out = subprocess.run(
        [BIBLE, "-f", f"{name} 1:1-999:999"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    ).stdout
    chapters: dict[int, list[str]] = {}
    for line in out.splitlines():
        match = VERSE.match(line)
        if match is None:
            raise SystemExit(f"{name}: unexpected line from {BIBLE}: {line!r}")
        chapters.setdefault(int(match["chapter"]), []).append(match["text"].strip())
    if not chapters or sorted(chapters) != list(range(1, len(chapters) + 1)):
        raise SystemExit(f"{name}: {BIBLE} printed chapters {sorted(chapters)}")
    return [chapters[number] for number in sorted(chapters)]


def corpus_chapters() -> list[list[str]]:
    return [chapter for book in BOOKS for chapter in read_book(book)]


def corpus_text(chapters: list[list[str]]) -> str:
    """One verse a line, a blank line between chapters (so ``--doc-separator
    blank-line`` reads back the same documents as corpus.jsonl)."""
    return "\n\n".join("\n".join(verses) for verses in chapters) + "\n"


def corpus_jsonl(chapters: list[list[str]]) -> str:
    return "".join(json.dumps({"text": "\n".join(verses)}) + "\n" for verses in chapters)


def train_tokenizer(corpus: Path) -> str:
    """A byte-level BPE of exactly VOCAB_SIZE ids, ``<|endoftext|>`` = 0, as JSON."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE or tokenizer.token_to_id(EOD) != 0:
        raise SystemExit(
            f"trained vocab {tokenizer.get_vocab_size()} with {EOD} = "
            f"{tokenizer.token_to_id(EOD)}; expected {VOCAB_SIZE} and 0"
        )
    return tokenizer.to_str(pretty=True) + "\n"


def build() -> dict[str, bytes]:
    """Every generated file's name and bytes (README.md is written by hand)."""
    chapters = corpus_chapters()
    text = corpus_text(chapters)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(text, encoding="utf-8")
        tokenizer = train_tokenizer(corpus)
    return {
        "corpus.txt": text.encode(),
        "corpus.jsonl": corpus_jsonl(chapters).encode(),
        "tokenizer.json": tokenizer.encode(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file would change")
    args = parser.parse_args()
    files = build()
    stale = [name for name, data in files.items() if _read(SAMPLE / name) != data]
    if args.check:
        for name in stale:
            print(f"{SAMPLE / name} is not what this script generates", file=sys.stderr)
        return 1 if stale else 0
    SAMPLE.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (SAMPLE / name).write_bytes(data)
        print(f"{SAMPLE / name}: {len(data):,} bytes")
    return 0


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


if __name__ == "__main__":
    sys.exit(main())
