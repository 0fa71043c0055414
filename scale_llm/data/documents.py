"""A document, the unit every source yields, and the checks one record's text passes.

Both kinds of source (local files and builtin: sources.py; Hugging Face datasets: hf_source.py)
read records into `Document`s through `text_value`, so a record is refused the same way
whichever source it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from scale_llm.errors import UserError

# One document is at most this many characters. Encoding costs ~50 bytes of memory per character
# (the text, its pieces, their ids), so this bounds prepare's memory per document at a few GB. A
# .jsonl line or a text file is read at most this many bytes (a character takes at least one),
# so a longer one is refused before it is read whole.
MAX_DOCUMENT_CHARS = 50_000_000
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Document:
    doc_id: str  # stable name: the file (and line or row) it came from; decides the split
    text: str


def text_value(value: Any, where: str, field: str) -> str | None:
    """The text of one record; None for null or blank; a clear error for a non-string, for a
    document over MAX_DOCUMENT_CHARS and for text that is not Unicode (a lone surrogate)."""
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
    # JSON can spell half of a UTF-16 pair (\ud800): valid syntax, but no UTF-8 text, and the
    # tokenizer would fail on it far from here. Only non-ASCII text can hold one.
    if not value.isascii() and (bad := _SURROGATE.search(value)):
        raise UserError(
            f"{where}: field {field!r} holds a lone surrogate (\\u{ord(bad.group()):04x} at "
            f"character {bad.start()}): half of a UTF-16 pair, which is not text; add the "
            f"missing half (\\ud83d\\ude00 is one emoji) or remove the record or the file "
            f"from data.source"
        )
    return value if value.strip() else None
