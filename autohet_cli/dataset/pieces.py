"""Documents cut into pieces of bounded length, so tokenizing costs bounded memory.

Why: a HuggingFace tokenizer holds about 170 bytes per character of the text it
encodes (ids, offsets, token strings, word ids), so one 30 MB document cost 5 GB and a
300 MB one would need 50 GB. Cut into pieces of at most ``piece_chars`` characters,
tokenized one after another, a document of any length costs what one piece costs.

Where a document is cut, most preferred first, looking back at most half a piece:

1. before a single space between two non-space characters (``word| word``): GPT-2,
   Llama 3 and Metaspace pre-tokenizers start a pre-token there, and BPE never merges
   across pre-tokens, so the tokens are exactly those of the whole document;
2. before the last whitespace character of a run that ends at a non-space
   (``a\\n|\\nb``), where GPT-2's pre-tokenizer also starts one;
3. before any whitespace character;
4. anywhere (a text with no whitespace for half a piece, e.g. minified data or
   unspaced CJK): a pre-token is cut in two there.

So the tokens of a cut document may differ from those of the whole one only at the
cuts, and only for tokenizers whose pre-tokens or normalizers look across them (no
pre-tokenizer at all, or a normalizer that prepends ``▁`` to every text, as Llama 2's
does: there each piece after the first starts with one more ``▁``). A document no
longer than ``piece_chars`` is never cut.

The pieces of a document are exactly its text: joined, they give it back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# Characters per piece: what one tokenizer call holds (~170 MB of tokenizer memory),
# and what a worker task holds anyway (``prepare.CHUNK_CHARS``).
PIECE_CHARS = 1 << 20
# Where to cut, most preferred first (see the module docstring); each match's start is
# the index at which the next piece begins.
_CUTS = (
    re.compile(r"(?<=\S) (?=\S)"),
    re.compile(r"\s(?=\S)"),
    re.compile(r"\s"),
)
# Characters searched back from the end of a piece before widening the search: the
# preferred cut is almost always within a few characters of the end.
_SEARCH_CHARS = 4096

# What a reader yields: (text, ends its document, bytes of the file read so far). A
# document is the text of its fragments up to one that ends it.
Fragment = tuple[str, bool, int]


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    starts_document: bool
    ends_document: bool
    bytes_read: int  # of the input file, when this piece was cut

    @property
    def whole_document(self) -> bool:
        return self.starts_document and self.ends_document


def cut_pieces(fragments: Iterable[Fragment], piece_chars: int) -> Iterator[Piece]:
    """Regroup a reader's fragments into pieces of at most ``piece_chars`` characters,
    each document's cut where ``cut_point`` says; empty documents are dropped."""
    parts: list[str] = []
    size, starts = 0, True
    for text, ends, bytes_read in fragments:
        if text:
            parts.append(text)
            size += len(text)
        if size > piece_chars:
            buffer, start = "".join(parts), 0
            while len(buffer) - start > piece_chars:
                cut = cut_point(buffer, start, piece_chars)
                yield Piece(buffer[start:cut], starts, False, bytes_read)
                starts, start = False, cut
            parts, size = [buffer[start:]], len(buffer) - start
        if ends:
            if size:
                yield Piece("".join(parts), starts, True, bytes_read)
            parts, size, starts = [], 0, True


def cut_point(text: str, start: int, piece_chars: int) -> int:
    """Where the piece of ``text`` starting at ``start`` ends (its length is in
    ``[piece_chars // 2, piece_chars]``); ``text`` runs on past ``start + piece_chars``."""
    end = start + piece_chars
    low = start + max(1, piece_chars // 2)
    for pattern in _CUTS:
        cut = _last_match(pattern, text, low, end)
        if cut is not None:
            return cut
    return end


def _last_match(pattern: re.Pattern[str], text: str, low: int, high: int) -> int | None:
    """The largest match start in ``[low, high]``, searching back from ``high`` in
    growing windows (lookarounds see the characters around the window)."""
    stop, width = high + 1, _SEARCH_CHARS
    while stop > low:
        begin = max(low, stop - width)
        found = None
        for match in pattern.finditer(text, begin, min(len(text), stop + 1)):
            if match.start() < stop:
                found = match.start()
        if found is not None:
            return found
        stop, width = begin, width * 4
    return None
