"""Free TCP ports: one probe for every caller, and a per-name cached pick for the config resolver.

`free_port(host)` binds port 0 on `host` and returns what the kernel picked (free a moment ago; a caller that
needs it must bind soon). `named_port(name)` picks once per process for each name, so `${relax_free_port:NAME}`
gives the same port on every access of the composed config.

Not done here: reserving a port (nothing holds it after the probe closes), or choosing among port ranges.
"""

from __future__ import annotations

import socket

_NAMED: dict[str, int] = {}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def named_port(name: str) -> int:
    """A free TCP port on 127.0.0.1 for `name`, picked once per process (the same on every access)."""
    if name not in _NAMED:
        _NAMED[name] = free_port()
    return _NAMED[name]
