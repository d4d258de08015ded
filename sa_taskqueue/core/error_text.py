"""What is stored as a task's ``last_error``, and what the worker logs of an error: storable and bounded.

A task can raise anything: a message with a NUL in it (which PostgreSQL
refuses to store), or one of 50 MB.  Recording the failure must not fail
because of it, nor fill the table and the logs, so every error text is made
storable (`make_storable`) and cut to at most `MAX_ERROR_LENGTH` characters.
The head says what went wrong and the tail where, so both are kept around a
marker saying how much was cut.

What is stored is also scrubbed of secrets (`format_error`'s ``redactor``): a
task that fails with "could not reach postgresql://app:pw@db/app" leaves
``***`` in the table where the password was, as the worker's log line shows.
"""

from __future__ import annotations

import traceback

from sa_taskqueue.core.redaction import Redactor, hide_secrets
from sa_taskqueue.core.storable_text import make_storable

#: Longest ``last_error`` stored, and longest error text a worker's log line carries, in characters.
MAX_ERROR_LENGTH = 64 * 1024

#: Room the worker's failure log line keeps for its own words (task id, name, attempt, duration).
LOG_LINE_ROOM = 1024

_MARKER = "\n... [{cut:,} characters cut] ...\n"


def bounded_text(text: str, limit: int = MAX_ERROR_LENGTH) -> str:
    """``text`` made storable and, when longer than ``limit``, cut in the middle to at most ``limit``."""
    text = make_storable(text)
    if len(text) <= limit:
        return text
    # The marker's length depends on the count it shows, which is less than len(text).
    keep = limit - len(_MARKER.format(cut=len(text)))
    head = keep // 2
    tail = keep - head
    marker = _MARKER.format(cut=len(text) - keep)
    return f"{text[:head]}{marker}{text[len(text) - tail :]}"


def format_error(error: BaseException | str, redactor: Redactor | None = None) -> str:
    """The exception's type, message and traceback (or the text given), storable, bounded and scrubbed.

    Given a ``redactor`` (a queue's: the secrets of its engine's URL), the
    text has those secrets, URL credentials and ``password=...`` values shown
    as ``***``.  The known secrets are hidden before the text is cut, so that
    no cut leaves a password's halves on either side of the marker; the
    patterns, which look at every word, run over the cut text alone.
    """
    text = "".join(traceback.format_exception(error)) if isinstance(error, BaseException) else str(error)
    if redactor is None:
        return bounded_text(text)
    scrubbed = redactor.text(bounded_text(hide_secrets(text, redactor.secrets)))
    # ``***`` can be longer than what it hides (an empty password): cut again if so.
    return bounded_text(scrubbed)


def error_message(error: BaseException) -> str:
    """The exception's message for a log line: storable, and short enough for the line to stay within
    `MAX_ERROR_LENGTH`."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure it reports
        text = f"<{type(error).__name__}: str() failed>"
    return bounded_text(text, MAX_ERROR_LENGTH - LOG_LINE_ROOM)


__all__ = ["LOG_LINE_ROOM", "MAX_ERROR_LENGTH", "bounded_text", "error_message", "format_error"]
