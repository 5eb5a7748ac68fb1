"""The TCP buffers of a server's connections, as the kernel reports them (the socket-buffer setting's tests)."""

from __future__ import annotations

import re
import subprocess


def tcp_buffers(port: int) -> list[tuple[int, int]]:
    """(receive, send) buffer of each established TCP socket whose local port is ``port`` (a server's side of its
    connections), from ``ss``'s socket memory (skmem rb / tb: what the kernel allows, after Linux doubles a
    requested SO_RCVBUF / SO_SNDBUF)."""
    out = subprocess.run(["ss", "-tmnH", "state", "established", f"sport = :{port}"], capture_output=True,
                         text=True, check=True).stdout
    return [(int(rb), int(tb)) for rb, tb in re.findall(r"rb(\d+),t\d+,tb(\d+)", out)]
