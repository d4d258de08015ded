"""Database URLs and error text with their secrets hidden: what the command line prints, what a queue stores.

A URL carries its password in the userinfo (``user:password@host``) and, for
many drivers, in query parameters (``?password=...``, ``?sslpassword=...``,
a token).  SQLAlchemy's ``render_as_string(hide_password=True)`` hides only
the first, and only in a URL it can parse; a URL it cannot parse is the one a
user is most likely to see echoed back in an error.  So a URL is shown with
every secret replaced by ``***``, whether it parses or not, and any text the
command line prints (its own errors, the driver's, log lines) is scrubbed of
the secrets of the URLs it was given, in case a driver echoes them.

A queue scrubs the error text it stores the same way, with the secrets of its
own engine's URL: a task that fails with "could not reach <the URL>" must not
leave the password in the table for ``sa-taskqueue show`` to print later.

The patterns only ever start at the beginning of a word, so scrubbing is
linear in the length of the text: an error message of 64 KB without a space
in it is scrubbed in milliseconds, not the minute a pattern retried at every
position would take.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, quote_plus, unquote

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

#: A key starts where a word starts (the look-behind): tried again at every
#: letter of a long word, the pattern would take time quadratic in its length.
_KEY = r"(?<![A-Za-z0-9_.-])[A-Za-z0-9_][A-Za-z0-9_.-]*+"
#: ``key=value`` in a query string or a libpq-style connection string.
_KEY_VALUE = re.compile(
    rf"(?P<key>{_KEY})(?P<eq>\s*=\s*)(?P<value>{re.escape(HIDDEN)}|'[^']*'|\"[^\"]*\"|[^\s&;,)]*+)"
)
#: The longest password the pattern below looks for: unbounded, a text of many
#: ``a://b:`` would be scanned to its end from each of them.  A longer secret
#: of a URL the command or the queue was given is still hidden, as a secret.
_LONGEST_PASSWORD = 1024
#: ``scheme://user:password@`` anywhere in a text (a scheme, too, starts where a word does).
_USERINFO = re.compile(
    r"(?P<start>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*+://[^\s/:@]*+)"
    rf":[^\s@]{{0,{_LONGEST_PASSWORD}}}+@"
)


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
    return {form for secret in found | decoded if secret for form in _written_forms(secret)}


def _written_forms(secret: str) -> set[str]:
    """``secret`` as a text may carry it: as is, and percent-encoded as a URL writes it.

    A task that names its database in an error formats the engine's URL,
    where SQLAlchemy writes an ``@`` or ``/`` of the password as ``%40``,
    ``%2F``; other code quotes it as ``urllib`` does.
    """
    rendered = sa.URL.create("x", username="u", password=secret, host="h").render_as_string(
        hide_password=False
    )
    in_url = rendered.removeprefix("x://u:").removesuffix("@h")
    return {secret, in_url, quote(secret, safe=""), quote_plus(secret)}


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
    text = hide_secrets(text, secrets)
    if "://" in text:
        text = _USERINFO.sub(rf"\g<start>:{HIDDEN}@", text)
    return _redact_key_values(text) if "=" in text else text


def hide_secrets(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` (of `MIN_SCRUBBED_LENGTH` characters or more) as ``***``, only.

    Plain substring replacement: what a long text goes through before it is
    cut (`redact_text`'s patterns then run over the cut text alone), so that
    no cut can leave a known secret's halves on either side of the marker.
    """
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= MIN_SCRUBBED_LENGTH:
            text = text.replace(secret, HIDDEN)
    return text


class Redactor:
    """The secrets of some URLs, and any text with them (and any URL credentials in it) hidden.

    The command line keeps one for every URL it was given, and scrubs what
    it prints; a queue keeps one for its engine's URL (`QueueParts.redactor`),
    and scrubs the error text it stores.
    """

    def __init__(self, *urls: str | sa.URL | None) -> None:
        self.secrets: set[str] = set()
        for url in urls:
            self.remember(url)

    def remember(self, url: str | sa.URL | None) -> None:
        """Hide the secrets of ``url`` from everything printed from now on."""
        if url:
            self.secrets |= url_secrets(url)

    def url(self, url: str | sa.URL) -> str:
        return redact_text(redact_url(url), self.secrets)

    def text(self, text: str) -> str:
        return redact_text(text, self.secrets)

    def value(self, value: Any) -> Any:
        """``value`` (a task's params or result: JSON's types) with every string in it scrubbed as `text`.

        The strings are scrubbed one by one, not the JSON text they make: a
        secret holding a quote or a backslash is written escaped in JSON, and
        would not be found there.
        """
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            scrubbed: dict[Any, Any] = {}
            for key, item in value.items():
                shown = self.value(key)
                # Two keys may scrub alike ("***"): each keeps its value, under a key of its own.
                unique, seen = shown, 1
                while unique in scrubbed:
                    seen += 1
                    unique = f"{shown} ({seen})"
                scrubbed[unique] = self.value(item)
            return scrubbed
        if isinstance(value, list | tuple):
            return [self.value(item) for item in value]
        return value


__all__ = [
    "HIDDEN",
    "Redactor",
    "has_unescaped_at",
    "hide_secrets",
    "is_secret_key",
    "redact_text",
    "redact_url",
    "url_secrets",
]
