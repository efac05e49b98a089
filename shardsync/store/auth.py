"""Using the shared secret (``store/secret.py``): checking a bearer token in constant time, and
signing store values so that only holders of the secret can write control messages or tensor
handles a peer acts on.

Threat model: ``docs/security.md``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket

from shardsync.store.secret import ENV_TOKEN, ENV_TOKEN_FILE


class Unauthorized(Exception):
    """No credentials on a call that needs them (HTTP 401)."""


class Forbidden(Exception):
    """Credentials that are not this engine's (HTTP 403)."""


def check_bearer(header: str | None, token: str) -> None:
    """Raise unless ``header`` is ``Bearer <token>``."""
    if not header:
        raise Unauthorized("this call changes the engine and needs `Authorization: Bearer <token>` "
                           f"(the trainer reads it from ${ENV_TOKEN}, ${ENV_TOKEN_FILE} or this user's secret file)")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Forbidden("wrong token: this engine was started with another shared secret")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (a server there is unreachable from others)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def mac(secret: str, key: str, body: str) -> str:
    """HMAC-SHA256 of a store value bound to its key (a value cannot be replayed elsewhere)."""
    return hmac.new(secret.encode(), f"{key}\0{body}".encode(), hashlib.sha256).hexdigest()


def verify_mac(secret: str, key: str, body: str, tag: str) -> bool:
    return hmac.compare_digest(mac(secret, key, body), tag)
