"""Database URLs and error text with their secrets hidden, for everything the command line prints.

A URL carries its password in the userinfo (``user:password@host``) and, for
many drivers, in query parameters (``?password=...``, ``?sslpassword=...``,
a token).  SQLAlchemy's ``render_as_string(hide_password=True)`` hides only
the first, and only in a URL it can parse; a URL it cannot parse is the one a
user is most likely to see echoed back in an error.  So a URL is shown with
every secret replaced by ``***``, whether it parses or not, and any text the
command line prints (its own errors, the driver's, log lines) is scrubbed of
the secrets of the URLs it was given, in case a driver echoes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote

import sqlalchemy as sa

HIDDEN = "***"

#: Parts of query-parameter (and connection-string keyword) names that carry
#: a secret: ``password``, ``sslpassword``, ``passwd``, ``pwd``, ``secret``,
#: ``client_secret``, ``token``, ``access_token``, ``api_key``, ...
SECRET_KEY_PARTS = ("pass", "pwd", "secret", "token", "credential", "apikey", "api_key", "private")

#: A secret shorter than this is not searched for in free text: hiding every
#: "ab" in an error message would make it unreadable.  URLs themselves are
#: always redacted by their structure, whatever the secret's length.
MIN_SCRUBBED_LENGTH = 4

_KEY = r"[A-Za-z_][A-Za-z0-9_.-]*"
#: ``key=value`` in a query string or a libpq-style connection string.
_KEY_VALUE = re.compile(
    rf"(?P<key>{_KEY})(?P<eq>\s*=\s*)(?P<value>{re.escape(HIDDEN)}|'[^']*'|\"[^\"]*\"|[^\s&;,)]*)"
)
#: ``scheme://user:password@`` anywhere in a text.
_USERINFO = re.compile(r"(?P<start>[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*):[^\s@]*@")


def is_secret_key(key: str) -> bool:
    """Whether a query parameter or connection keyword named ``key`` carries a secret."""
    lowered = key.lower()
    return any(part in lowered for part in SECRET_KEY_PARTS)


def redact_url(url: str | sa.URL) -> str:
    """``url`` as people may see it: password and secret query values shown as ``***``.

    A URL SQLAlchemy cannot parse (or parses into a host holding an ``@``,
    from a password with an unescaped ``@``) keeps its scheme and what
    follows its last ``@``; everything before, the credentials, is hidden.
    """
    if isinstance(url, sa.URL):
        parsed = url
        url = url.render_as_string(hide_password=False)
    else:
        try:
            parsed = sa.make_url(url)
        except (sa.exc.ArgumentError, ValueError, TypeError):
            return _redact_raw(url)
    if has_unescaped_at(parsed):
        return _redact_raw(url)
    return _render(parsed)


def has_unescaped_at(url: sa.URL) -> bool:
    """Whether ``url``'s host holds an ``@``: part of a password whose ``@`` was not written ``%40``."""
    return url.host is not None and "@" in url.host


def _render(url: sa.URL) -> str:
    query = {key: (HIDDEN if is_secret_key(key) else value) for key, value in url.query.items()}
    return url.set(query=query).render_as_string(hide_password=True)


def _redact_raw(url: str) -> str:
    scheme, separator, rest = url.partition("://")
    if not separator:
        scheme, rest = "", url
    if "@" in rest:
        rest = f"{HIDDEN}@{rest.rpartition('@')[2]}"
    return f"{scheme}{separator}{_redact_key_values(rest)}"


def _redact_key_values(text: str) -> str:
    def hide(match: re.Match[str]) -> str:
        if not is_secret_key(match.group("key")):
            return match.group(0)
        return f"{match.group('key')}{match.group('eq')}{HIDDEN}"

    return _KEY_VALUE.sub(hide, text)


def url_secrets(url: str | sa.URL) -> set[str]:
    """The secret values in ``url`` (as written and percent-decoded), to scrub from free text."""
    found: set[str] = set()
    parsed: sa.URL | None
    if isinstance(url, sa.URL):
        parsed = url
    else:
        try:
            parsed = sa.make_url(url)
        except (sa.exc.ArgumentError, ValueError, TypeError):
            parsed = None
        found |= _raw_secrets(url)
    if parsed is not None:
        if parsed.password:
            found.add(str(parsed.password))
        for key, value in parsed.query.items():
            if is_secret_key(key):
                found.update([value] if isinstance(value, str) else value)
    decoded = {unquote(secret) for secret in found}
    return {secret for secret in found | decoded if secret}


def _raw_secrets(url: str) -> set[str]:
    """What may be a secret in ``url`` read as plain text: the userinfo's password, secret keys' values."""
    found: set[str] = set()
    rest = url.partition("://")[2] or url
    if "@" in rest:
        userinfo = rest.rpartition("@")[0]
        password = userinfo.partition(":")[2]
        # A driver may name the host it could not find: with an unescaped @
        # in the password, that "host" is the password's tail.
        found.update([password, *password.split("@")])
    for match in _KEY_VALUE.finditer(rest):
        if is_secret_key(match.group("key")):
            found.add(match.group("value").strip("'\""))
    return found


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with ``secrets``, URL credentials and ``password=...`` style values replaced by ``***``."""
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= MIN_SCRUBBED_LENGTH:
            text = text.replace(secret, HIDDEN)
    text = _USERINFO.sub(rf"\g<start>:{HIDDEN}@", text)
    return _redact_key_values(text)


class Redactor:
    """The secrets of the URLs one command was given, and the text it prints with them hidden."""

    def __init__(self) -> None:
        self.secrets: set[str] = set()

    def remember(self, url: str | sa.URL | None) -> None:
        """Hide the secrets of ``url`` from everything printed from now on."""
        if url:
            self.secrets |= url_secrets(url)

    def url(self, url: str | sa.URL) -> str:
        return redact_text(redact_url(url), self.secrets)

    def text(self, text: str) -> str:
        return redact_text(text, self.secrets)


__all__ = [
    "HIDDEN",
    "Redactor",
    "has_unescaped_at",
    "is_secret_key",
    "redact_text",
    "redact_url",
    "url_secrets",
]
