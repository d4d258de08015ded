"""Who may use the dashboard, and proof that a POST comes from its own pages.

Authentication is one of: none (the dashboard is bound to a loopback
address, or the host application guards the mount), a token, or a callable
of the host application.  A token is accepted from an ``Authorization:
Bearer`` header, or once from ``?token=`` on a page, which sets a session
cookie signed with a secret of this process and redirects to the same page
without the token (so it stays out of history, logs and referrers).

Every POST carries ``csrf_token``: an HMAC of this process's secret and a
random value held in a cookie of its own (the signed double-submit
pattern).  A page from another site can neither read the cookie nor compute
the HMAC, so a form it submits is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import secrets
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

#: The session cookie set after a page is opened with ``?token=``.
SESSION_COOKIE = "sa_taskqueue_dashboard"
#: The random value the CSRF token is an HMAC of.
CSRF_COOKIE = "sa_taskqueue_csrf"
#: One message shown on the page a POST redirects back to.
FLASH_COOKIE = "sa_taskqueue_flash"

Auth = str | Callable[[Request], bool] | None

#: The response headers of every page: nothing inline runs, nothing frames it, nothing is cached.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class Guard:
    """The dashboard's authentication and CSRF checks, with a secret made when the app is."""

    def __init__(self, auth: Auth) -> None:
        if auth is not None and not isinstance(auth, str) and not callable(auth):
            raise TypeError(f"auth must be None, a token string or a callable(request) -> bool, got {auth!r}")
        if isinstance(auth, str) and not auth:
            raise ValueError("auth: an empty token would let anyone in; give a token, or None for no auth")
        self.auth = auth
        self._secret = secrets.token_bytes(32)

    def _sign(self, purpose: str, value: str) -> str:
        return hmac.new(self._secret, f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()

    # Authentication ---------------------------------------------------------

    def token_matches(self, given: str | None) -> bool:
        """Whether ``given`` is the configured token (compared in constant time)."""
        return (
            isinstance(self.auth, str)
            and given is not None
            and hmac.compare_digest(given.encode(), self.auth.encode())
        )

    def new_session(self) -> str:
        """A session cookie value: a random id and its signature."""
        session = secrets.token_urlsafe(24)
        return f"{session}.{self._sign('session', session)}"

    async def allowed(self, request: Request) -> bool:
        """Whether ``request`` may see the dashboard.

        A host callable runs in a thread (it may block on a database lookup),
        or is awaited when it is a coroutine function; only ``True`` lets the
        request in, so a coroutine returned by mistake is a refusal, not a pass.
        """
        if self.auth is None:
            return True
        if callable(self.auth):
            check = self.auth
            if inspect.iscoroutinefunction(check):
                verdict = await check(request)
            else:
                verdict = await run_in_threadpool(check, request)
            if inspect.isawaitable(verdict):
                verdict = await verdict
            return verdict is True
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.token_matches(credentials.strip()):
            return True
        session, _, signature = request.cookies.get(SESSION_COOKIE, "").partition(".")
        return bool(session) and hmac.compare_digest(signature, self._sign("session", session))

    # CSRF -------------------------------------------------------------------

    def csrf_seed(self, request: Request) -> tuple[str, bool]:
        """The random value of this browser's CSRF cookie, and whether it is new (to be set)."""
        seed = request.cookies.get(CSRF_COOKIE)
        if seed and len(seed) <= 128:
            return seed, False
        return secrets.token_urlsafe(24), True

    def csrf_token(self, seed: str) -> str:
        return self._sign("csrf", seed)

    def csrf_valid(self, request: Request, form_token: Any) -> bool:
        """Whether the form's ``csrf_token`` is the HMAC of the request's CSRF cookie."""
        seed = request.cookies.get(CSRF_COOKIE)
        if not seed or not isinstance(form_token, str) or not form_token:
            return False
        return hmac.compare_digest(form_token, self.csrf_token(seed))


def without_token(request: Request) -> str:
    """The request's path and query (relative to the server) with ``token`` left out."""
    query = [(key, value) for key, value in request.query_params.multi_items() if key != "token"]
    path = full_path(request)
    return f"{path}?{urlencode(query)}" if query else path


def full_path(request: Request) -> str:
    """The request's path from the server's root, the mount point included."""
    root, path = str(request.scope.get("root_path", "")), str(request.scope["path"])
    # Starlette keeps the mount point in "path" (and says where it ends in "root_path").
    return path if path.startswith(root) else root + path


def mount_point(request: Request) -> str:
    """Where the dashboard is mounted ('' at the server's root): every link starts with it."""
    return str(request.scope.get("root_path", "")).rstrip("/")
