"""The `gateway` node as one record (`GatewaySettings`), and the rules of where a gateway may listen.

`GatewaySettings` checks its own bind keys as it is made (`check_bind`: a bind other hosts can reach needs
`gateway.allow_remote=true`; a port out of range is refused). `gateway.public_url` is checked against the
protocol's service prefix, a key of another node, by `GatewaySettings.check_public_url`, which the run's builder
calls (`recipes/parts.py`) and the `GatewayServer` constructor calls again. Every error names the key, the value
and the fix. Nothing here binds a socket (`gateway/server.py` does).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Hosts that bind every interface."""


@dataclass
class GatewaySettings:
    """The `gateway` node; connects the config to `GatewayServer` (where it listens, what agents are told)."""

    host: str = "127.0.0.1"
    """Address to bind: 127.0.0.1 (this machine only), one of this machine's addresses, or 0.0.0.0 / :: (every
    interface). Anything but loopback needs gateway.allow_remote=true."""
    port: int = 0
    """TCP port; 0 picks a free one (run.log says which)."""
    public_url: str | None = None
    """Base URL agents are given (RELAX_BASE_URL, also what agent.executor=http sends), such as
    http://node0.cluster:8000/agentic_api/: keeps protocol.service_prefix and ends with '/'. None: derived from
    the bound address (a wildcard bind advertises this machine's primary address)."""
    allow_remote: bool = False
    """Allow a bind other hosts can reach; sessions then authenticate only with RELAX_API_KEY. false: loopback
    binds only, where a session's RELAX_SESSION_ID also opens that session."""

    def __post_init__(self) -> None:
        check_bind(self.host, self.port, self.allow_remote)

    def check_public_url(self, prefix: str) -> None:
        """`gateway.public_url`, when set, keeps `prefix` (`protocol.service_prefix`) and ends with `/`."""
        if self.public_url is not None:
            check_public_url(self.public_url, prefix)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) binds only this machine's loopback interface."""
    if host in WILDCARD_HOSTS:
        return False
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_bind(host: str, port: int, allow_remote: bool) -> None:
    """Refuse a bind other hosts could reach unless `gateway.allow_remote=true`; refuse a port out of range."""
    if not 0 <= port <= 65535:
        raise ValueError(f"gateway.port={port} is not a TCP port; use 0 (a free port) or 1-65535")
    if allow_remote or is_loopback(host):
        return
    raise ValueError(f"gateway.host={host!r} is not a loopback address, so other hosts could reach the gateway; set "
                     "gateway.allow_remote=true to serve agents elsewhere (sessions then authenticate only with "
                     "their RELAX_API_KEY), or bind gateway.host=127.0.0.1")


def check_public_url(url: str, prefix: str) -> None:
    """`gateway.public_url` must be an http(s) URL that keeps the service prefix and ends with `/`."""
    parts = urlsplit(url)
    path = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    problems = []
    if parts.scheme not in ("http", "https") or not parts.netloc:
        problems.append("it must start with http:// or https:// and name a host")
    if not parts.path.endswith(path):
        problems.append(f"its path must end with the service prefix and a slash, {path!r} (protocol.service_prefix)")
    if parts.query or parts.fragment:
        problems.append("it must have no query or fragment")
    if problems:
        example = f"http://HOST:PORT{path}"
        raise ValueError(f"gateway.public_url={url!r}: {'; '.join(problems)}; for example {example}")
