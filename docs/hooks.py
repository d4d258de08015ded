"""MkDocs hook: render the examples' test fences as plain Python code blocks.

The ```python fences of these pages run as tests (see conftest.py), and some carry
pytest-markdown-docs' words after the language: ``notest``, ``continuation`` and
``fixture:NAME``.  Python-Markdown's fences accept a language alone, so before a page is
rendered each such opening fence is shown as ```python.  The Markdown files themselves are
not changed.
"""

from __future__ import annotations

import re
from typing import Any

#: An opening ```python fence with words after the language.
TEST_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})python[ \t]+[^`\n]*$", re.MULTILINE)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return TEST_FENCE.sub(r"\g<indent>\g<fence>python", markdown)
