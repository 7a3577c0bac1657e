"""Which port an engine replica's own HTTP server listens on (``HIVE_ENGINE_PORT_RANGE``).

Unset, the OS picks a free ephemeral port (a laptop or CI box needs nothing else). Set to a
range such as ``20000-20999`` (Kubernetes, firewalls: the NetworkPolicy in ``manifests/``
opens exactly that range between Ray pods), the replica takes the first port of the range
that it can bind and listen on. No Ray import here: unit-tested with plain sockets.
"""

from __future__ import annotations

import errno
import re
import socket

_RANGE = re.compile(r"^\s*(\d{1,5})\s*-\s*(\d{1,5})\s*$")


class PortRangeError(ValueError):
    """A malformed range, or one whose every port is taken."""


def parse_port_range(text: str) -> tuple[int, int]:
    """``"20000-20999"`` -> ``(20000, 20999)``; a single port ``"20000"`` is a range of one."""
    single = text.strip()
    if single.isdigit():
        text = f"{single}-{single}"
    m = _RANGE.match(text)
    if not m:
        raise PortRangeError(f"HIVE_ENGINE_PORT_RANGE={text!r} is not a port range: write it as LOW-HIGH, e.g. 20000-20999")
    low, high = int(m.group(1)), int(m.group(2))
    if not 1 <= low <= high <= 65535:
        raise PortRangeError(
            f"HIVE_ENGINE_PORT_RANGE={text!r}: need 1 <= LOW <= HIGH <= 65535, e.g. 20000-20999")
    return low, high


def listen_in_range(port_range: tuple[int, int] | None, host: str = "0.0.0.0") -> socket.socket:
    """A TCP socket bound and listening on the first free port of ``port_range`` (any free port if None).

    Listening right away closes the window in which two replicas on one node could both bind
    the same port (Linux lets two SO_REUSEADDR sockets bind one port until one listens).
    """
    ports = [0] if port_range is None else range(port_range[0], port_range[1] + 1)
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(2048)
            return sock
        except OSError as e:
            sock.close()
            if port == 0 or e.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
    low, high = port_range  # type: ignore[misc]
    raise PortRangeError(
        f"no free port in HIVE_ENGINE_PORT_RANGE={low}-{high} on {host}: every port is taken "
        f"({high - low + 1} ports); widen the range or run fewer engine replicas on this node")
