"""Text every database can store: no NUL character and no unpaired surrogate.

PostgreSQL refuses NUL in ``text`` and in ``jsonb`` strings (and aborts the
transaction that tried), and no driver can encode a lone UTF-16 surrogate
(``'\\ud800'``) in UTF-8.  What an application hands the queue is refused
when it holds either (`unstorable_character`); what the queue writes on its
own account, an error's text, has them replaced instead (`make_storable`), so
that recording a failure cannot fail.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def unstorable_character(text: str) -> str | None:
    """What in ``text`` no database stores, said for an error message; None when it is all storable.

    Scans in C only: a NUL test, then, for non-ASCII text alone, one regular
    expression search (valid pairs never reach a Python ``str`` as surrogates).
    """
    if "\x00" in text:
        return "a NUL character (\\x00)"
    if not text.isascii():
        found = _SURROGATE.search(text)
        if found is not None:
            return f"an unpaired surrogate ({found.group().encode('unicode_escape').decode()})"
    return None


def make_storable(text: str) -> str:
    """``text`` with each NUL written as ``\\x00`` and each unpaired surrogate as its ``\\udXXX`` escape."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii() and _SURROGATE.search(text) is not None:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


__all__ = ["make_storable", "unstorable_character"]
