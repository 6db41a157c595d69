"""Peer → peer copies that do not pass through the controller.

The source host serves the one file once on a port of its cluster address
(``SERVE``, standard library only); the destination host connects and writes it
to a temp file that is renamed into place (``FETCH``). No credentials between
hosts are needed, and nothing listens longer than the copy (or ``TIMEOUT_S``).
When the destination cannot reach the source — different networks, a
firewall — the caller relays through the controller instead. The sha256 check
after the copy is the caller's, as for every other source.
"""

from __future__ import annotations

import time

from autohet_cli.cluster import Host, python_for
from autohet_cli.errors import AutohetError
from autohet_cli.transport.base import Runner

TIMEOUT_S = 120

SERVE = r"""
import socket, sys
path, addr, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
src = open(path, "rb")  # fail before offering a port if the file is not there
srv = socket.socket()
srv.bind((addr, 0))
srv.listen(1)
srv.settimeout(timeout)
print("PORT", srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
with conn, src:
    while chunk := src.read(1 << 20):
        conn.sendall(chunk)
"""

FETCH = r"""
import os, socket, sys
addr, port, dest, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
os.makedirs(os.path.dirname(dest), exist_ok=True)
tmp = dest + ".autohet-part"
with socket.create_connection((addr, port), timeout=timeout) as s, open(tmp, "wb") as f:
    while chunk := s.recv(1 << 20):
        f.write(chunk)
os.replace(tmp, dest)
"""


def direct_copy(
    src: Runner, src_host: Host, path: str, dest: Runner, dest_host: Host, dest_path: str
) -> None:
    """Copy ``path`` on ``src_host`` to ``dest_path`` on ``dest_host`` over one TCP stream."""
    bind = "127.0.0.1" if src_host.is_local else src_host.address
    port: list[int] = []

    def on_line(_stream: str, line: str) -> None:
        if line.startswith("PORT "):
            port.append(int(line.split()[1]))

    server = src.start(
        [python_for(src_host), "-c", SERVE, path, bind, str(TIMEOUT_S)], on_line=on_line
    )
    try:
        deadline = time.monotonic() + 20
        while not port and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not port:
            raise AutohetError(f"{src_host.name}: could not serve {path} (no port)")
        dest.run(
            [python_for(dest_host), "-c", FETCH, bind, str(port[0]), dest_path, str(TIMEOUT_S)],
            timeout_s=TIMEOUT_S + 10,
        ).check()
        if server.wait(30) != 0:
            raise AutohetError(f"{src_host.name}: serving {path} failed")
    finally:
        if server.poll() is None:
            server.kill(1.0)
