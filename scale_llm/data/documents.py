"""A document, the unit every source yields, and the checks one record's text passes (the same
for every kind of source: `text_value`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from scale_llm.errors import UserError

# At ~50 bytes of encoding memory a character, this bounds prepare's memory per document at a few
# GB; a .jsonl line or text file is read at most this many bytes, so a longer one is refused early.
MAX_DOCUMENT_CHARS = 50_000_000
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Document:
    doc_id: str  # stable name: the file (and line or row) it came from; decides the split
    text: str


def text_value(value: Any, where: str, field: str) -> str | None:
    """The text of one record (None: null or blank); refused unless it is a string of text."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise UserError(
            f"{where}: field {field!r} holds {type(value).__name__}, not text; set "
            f"data.text_field to a string field"
        )
    if len(value) > MAX_DOCUMENT_CHARS:
        raise UserError(
            f"{where}: field {field!r} holds {len(value):,} characters, more than the "
            f"{MAX_DOCUMENT_CHARS:,} one document may hold; split it into smaller documents"
        )
    # JSON can spell half a UTF-16 pair (\ud800), which the tokenizer would fail on far from here
    if not value.isascii() and (bad := _SURROGATE.search(value)):
        raise UserError(
            f"{where}: field {field!r} holds a lone surrogate (\\u{ord(bad.group()):04x} at "
            f"character {bad.start()}): half of a UTF-16 pair, which is not text; add the missing "
            f"half (\\ud83d\\ude00 is one emoji) or remove the record or the file from data.source"
        )
    return value if value.strip() else None
