"""Whether this process can listen on a host and port: what `serve` checks before it starts
anything, without the gRPC stack (it imports no torch)."""

from __future__ import annotations

import socket


class PortTaken(OSError):
    """A port this process must listen on is taken; the message names the port and the role."""


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a listener could not bind `host:port` now (None: it could)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT leftovers, as servers do
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def port_free(host: str, port: int) -> bool:
    """Can a listener bind `host:port` now (no other process listening there)?"""
    return _bind_error(host, port) is None


def unusable_host(host: str) -> str | None:
    """Why nothing can listen on `host` at all (not an address of this machine, ...), or None."""
    e = _bind_error(host, 0)  # any free port: only the address is in question
    return None if e is None else e.strerror or str(e)
