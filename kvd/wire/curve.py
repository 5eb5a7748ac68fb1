"""CURVE encryption for kvd's ZeroMQ sockets: :class:`CurveConfig` (the keys of one side, with the server's
client allow-list), :func:`keygen` (writes key pairs, ``kvd keygen``) and :class:`AllowList` (the ZAP
credentials provider a server's authenticator asks about each client key). Keys are Z85 bytes as
``zmq.auth.create_certificates`` writes them."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth

from kvd.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["ZAP_DOMAIN", "AllowList", "CurveConfig", "keygen"]

_Z85_KEY_CHARS = 40
ZAP_DOMAIN = "kvd"  # the ZAP domain of kvd's sockets: the authenticator's allow-list applies to it


def _key(value: Any, what: str) -> bytes:
    raw = value.encode("ascii") if isinstance(value, str) else value
    if not isinstance(raw, bytes) or len(raw) != _Z85_KEY_CHARS:
        raise ConfigError(f"{what} must be a {_Z85_KEY_CHARS}-character Z85 CURVE key, got {type(value).__name__}")
    return raw


def _load(path: str | os.PathLike[str], *, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the CURVE key file {os.fspath(path)!r}: {exc}") from None
    if need_secret and secret is None:
        raise ConfigError(f"{os.fspath(path)!r} holds no secret key (use the *.key_secret file)")
    return public, secret


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveConfig:
    """CURVE keys of one side (Z85 bytes, as ``zmq.auth.create_certificates`` writes them; see :func:`keygen`).

    A server sets ``public_key``/``secret_key`` and optionally ``authorized_keys`` (client public keys allowed to
    connect; None = any client that knows the server's public key). A client sets its own pair and
    ``server_public_key``. Build one with :meth:`for_server` / :meth:`for_client`. Raises :class:`ConfigError`.
    """

    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_public_key: bytes | None = None
    authorized_keys: frozenset[bytes] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", _key(self.public_key, "public_key"))
        object.__setattr__(self, "secret_key", _key(self.secret_key, "secret_key"))
        if self.server_public_key is not None:
            object.__setattr__(self, "server_public_key", _key(self.server_public_key, "server_public_key"))
        if self.authorized_keys is not None:
            keys = frozenset(_key(k, "authorized key") for k in self.authorized_keys)
            object.__setattr__(self, "authorized_keys", keys)

    @classmethod
    def for_server(cls, *, secret_key_file: str | os.PathLike[str],
                   authorized_keys_dir: str | os.PathLike[str] | None = None) -> CurveConfig:
        """The server's key pair from ``secret_key_file`` (``NAME.key_secret``); allowed clients are the public
        keys (``*.key``) in ``authorized_keys_dir`` (None: any client with the server's public key)."""
        public, secret = _load(secret_key_file, need_secret=True)
        allowed = None
        if authorized_keys_dir is not None:
            if not os.path.isdir(authorized_keys_dir):
                raise ConfigError(f"authorized_keys {os.fspath(authorized_keys_dir)!r} is not a directory")
            allowed = frozenset(zmq.auth.load_certificates(os.fspath(authorized_keys_dir)))
            if not allowed:
                raise ConfigError(f"authorized_keys {os.fspath(authorized_keys_dir)!r} holds no *.key file: "
                                  "no client could connect")
        assert secret is not None
        return cls(public_key=public, secret_key=secret, authorized_keys=allowed)

    @classmethod
    def for_client(cls, *, server_public_key_file: str | os.PathLike[str],
                   secret_key_file: str | os.PathLike[str] | None = None) -> CurveConfig:
        """A client's config: the server's public key, and this client's pair from ``secret_key_file`` (None: a
        fresh pair per process, accepted only by servers without an allow-list)."""
        server_public, _ = _load(server_public_key_file, need_secret=False)
        if secret_key_file is None:
            public, secret = zmq.curve_keypair()
        else:
            public, maybe = _load(secret_key_file, need_secret=True)
            assert maybe is not None
            secret = maybe
        return cls(public_key=public, secret_key=secret, server_public_key=server_public)

    def apply_client(self, sock: zmq.Socket[Any]) -> None:
        """Set this client's keys on ``sock`` (before connect)."""
        if self.server_public_key is None:
            raise ConfigError("a client CurveConfig needs server_public_key (CurveConfig.for_client)")
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_serverkey = self.server_public_key


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
    """Write a CURVE key pair ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600) into ``directory``
    (created with mode 0700 if missing). Returns ``(public_file, secret_file)``."""
    if not name or os.sep in name or name.startswith("."):
        raise ConfigError(f"key name must be a plain file name, got {name!r}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.auth.create_certificates(os.fspath(directory), name)
    os.chmod(secret, 0o600)
    return str(public), str(secret)


class AllowList:
    """ZAP credentials provider for ThreadAuthenticator: a fixed set of Z85 client public keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        if not allowed:
            log.warning("CURVE: refused a client key that is not on the allow-list: %s", key.decode("ascii"))
        return allowed
