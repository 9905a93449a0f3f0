"""Bearer-token access: who may read and who may write.

* No token configured: anyone who can reach the port may search (the server binds
  127.0.0.1 unless told otherwise); writes are refused (403), because a write without
  a credential would let any local process rewrite the index.
* A token configured (``--token-file FILE`` or the ``TWOTOWER_TOKEN`` environment
  variable): every read and write needs ``Authorization: Bearer <token>`` (401 otherwise).
* ``--read-only``: writes are refused (403) whatever the token.

``/health``, the page, its static files and the API description stay public: they show
nothing of the index's contents.  Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from fastapi import Request

from twotower.serve.errors import ApiError

TOKEN_ENV = "TWOTOWER_TOKEN"
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def load_token(token_file: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The configured token: the file's first line (``--token-file``), else ``$TWOTOWER_TOKEN``, else None."""
    if token_file:
        if not os.path.isfile(token_file):
            raise FileNotFoundError(f"--token-file: {token_file} not found")
        with open(token_file, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"--token-file: {token_file} is empty")
        return token
    token = (environ if environ is not None else os.environ).get(TOKEN_ENV, "").strip()
    return token or None


@dataclass(frozen=True)
class Access:
    """The access policy of one server."""

    token: str | None = None
    read_only: bool = False

    @property
    def auth_required(self) -> bool:
        return self.token is not None

    @property
    def writable(self) -> bool:
        return not self.read_only and self.token is not None

    def _check_token(self, request: Request) -> None:
        if self.token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if not header:
            raise ApiError(401, "this server needs a bearer token: send 'Authorization: Bearer <token>'",
                           "Authorization", headers=_CHALLENGE)
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise ApiError(401, "invalid bearer token", "Authorization", headers=_CHALLENGE)

    async def reader(self, request: Request) -> None:
        """FastAPI dependency of every read endpoint (async: no thread-pool hop)."""
        self._check_token(request)

    async def writer(self, request: Request) -> None:
        """FastAPI dependency of every write endpoint."""
        self._check_token(request)  # 401 first: a caller without the token learns nothing more
        if self.read_only:
            raise ApiError(403, "this server was started with --read-only: writes are refused")
        if self.token is None:
            raise ApiError(403, f"writes are disabled: start the server with --token-file FILE or {TOKEN_ENV} "
                                "set, and send that token")
