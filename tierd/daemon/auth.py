"""Who is calling: bearer token -> tenant. (Which tenant owns each engine id is the node
store's engine table, ``tierd.daemon.engines``.)

Tenancy comes from the connection, never from a request field. A caller that sends
``authorization: Bearer TOKEN`` is the token's tenant (an unknown token is UNAUTHENTICATED, over
any transport). A caller without a token is the default tenant over the Unix socket (whoever can
open the socket file is trusted, as with Docker's) and UNAUTHENTICATED over TCP.

An ``admin_token`` (config) is no tenant: its caller reads every tenant's usage and quota in
``Stats`` and makes no other call (UNAUTHENTICATED).

The token file is TOML, one line per token::

    "3f9c...e1" = "team-a"
    "77b0...4d" = "team-b"
"""

from __future__ import annotations

import hmac
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierd.daemon.errors import Unauthenticated


@dataclass(frozen=True, slots=True)
class TokenTable:
    """Bearer tokens and their tenants, loaded once at start-up."""

    tenants: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None) -> TokenTable:
        """Read a token file (``None``: no tokens). ``ValueError`` naming the fix on a bad file."""
        if path is None:
            return cls()
        with open(path, "rb") as f:
            try:
                table = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"token file {path}: {exc}; write lines like "
                                 "'\"TOKEN\" = \"tenant\"'") from None
        for token, tenant in table.items():
            if not isinstance(tenant, str) or not tenant or not token:
                raise ValueError(f"token file {path}: each line must be '\"TOKEN\" = \"tenant\"' "
                                 f"with a non-empty tenant, got {token!r} = {tenant!r}")
        return cls(dict(table))

    def with_token(self, token: str, tenant: str) -> TokenTable:
        """This table plus ``token`` -> ``tenant`` (``tcp_token``); ValueError if the token
        file gives that token to another tenant."""
        if self.tenants.get(token, tenant) != tenant:
            raise ValueError(f"tcp_token is also in the token file, for tenant "
                             f"{self.tenants[token]!r}: use another token")
        return TokenTable({**self.tenants, token: tenant})

    def tenant_of(self, token: str) -> str | None:
        """The tenant of ``token``, or None if unknown (constant-time per entry)."""
        found = None
        for known, tenant in self.tenants.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        return found


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` metadata entry, or None if absent."""
    for key, value in metadata:
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated("authorization metadata must be 'Bearer TOKEN'")
            return token.strip()
    return None


def is_unix_peer(peer: str) -> bool:
    """True for a gRPC peer string of a Unix-socket connection (``unix:...``)."""
    return peer.startswith("unix:")


@dataclass(frozen=True, slots=True)
class Authenticator:
    """Resolves the tenant of a call from its transport and metadata."""

    tokens: TokenTable
    default_tenant: str
    admin_token: str = ""
    """Its caller reads every tenant's Stats and nothing else ('' = no such caller)."""

    def __post_init__(self) -> None:
        if self.admin_token and self.tokens.tenant_of(self.admin_token) is not None:
            raise ValueError("admin_token is also a tenant's token in token_file: give the "
                             "admin its own token")

    def is_admin(self, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        """Whether the call carries the admin token."""
        token = bearer_token(metadata)
        return bool(self.admin_token) and token is not None and hmac.compare_digest(
            token.encode(), self.admin_token.encode())

    def tenant(self, peer: str, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The caller's tenant; raises ``Unauthenticated`` for a bad token, no token on TCP, or
        the admin token (it reads Stats only)."""
        metadata = list(metadata)
        if self.is_admin(metadata):
            raise Unauthenticated("the admin token reads Stats only: engines call with a "
                                  "tenant's token from the token file")
        token = bearer_token(metadata)
        if token is None:
            if is_unix_peer(peer):
                return self.default_tenant
            raise Unauthenticated("a bearer token is required over TCP: send metadata "
                                  "'authorization: Bearer TOKEN' from the daemon's token file")
        tenant = self.tokens.tenant_of(token)
        if tenant is None:
            raise Unauthenticated("unknown bearer token")
        return tenant
