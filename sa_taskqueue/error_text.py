"""`format_error`: what is stored as a task's ``last_error``."""

from __future__ import annotations

import traceback

#: Longest stored ``last_error``; the head and the tail of a traceback are kept.
MAX_ERROR_LENGTH = 60_000


def format_error(error: BaseException | str) -> str:
    """The exception's type, message and traceback, shortened in the middle if very long.

    The head says what went wrong and the tail where, so both are kept.
    """
    text = "".join(traceback.format_exception(error)) if isinstance(error, BaseException) else str(error)
    if len(text) > MAX_ERROR_LENGTH:
        half = MAX_ERROR_LENGTH // 2
        text = f"{text[:half]}\n... [{len(text) - MAX_ERROR_LENGTH} characters cut] ...\n{text[-half:]}"
    return text


__all__ = ["MAX_ERROR_LENGTH", "format_error"]
