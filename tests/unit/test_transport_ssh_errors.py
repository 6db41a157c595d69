"""Every SSH transport error names its host, what was being done and the cause, also
when the cause has no message (issue 29, medium 9: a host whose sshd died as a session
opened gave "cannot open an SSH session: ", the EOFError's empty text).

The server is a real paramiko SSH server in this process on 127.0.0.1: it accepts
our key, then closes the connection when a session channel is asked for, as an sshd
killed at that moment does."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from autohet_cli.cluster import Host
from autohet_cli.errors import HostUnreachable
from autohet_cli.transport.ssh import SshRunner
from autohet_cli.transport.target import SshOptions
from tests.planting import cpu_host


class _DiesOnSession(paramiko.ServerInterface):
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL

    def check_channel_request(self, kind: str, chanid: int) -> int:
        self.sock.shutdown(socket.SHUT_RDWR)  # gone, mid-request: no reply, no reason
        return paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED


@pytest.fixture
def dying_server(tmp_path: Path) -> Iterator[tuple[Host, SshOptions]]:
    host_key = paramiko.RSAKey.generate(1024)
    client_key = paramiko.RSAKey.generate(1024)
    client_key.write_private_key_file(str(tmp_path / "id_rsa"))
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    stop = threading.Event()
    transports: list[paramiko.Transport] = []

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            t = paramiko.Transport(conn)
            t.add_server_key(host_key)
            t.start_server(server=_DiesOnSession(conn))
            transports.append(t)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_key.get_name()} {host_key.get_base64()}\n")
    (tmp_path / "ssh_config").write_text("")
    host = cpu_host(
        "gone-1", "127.0.0.1", port=port, user="u", identity_file=str(tmp_path / "id_rsa")
    )
    options = SshOptions(
        known_hosts=known,
        ssh_config=tmp_path / "ssh_config",
        connect_timeout_s=5.0,
        allow_agent=False,
        look_for_keys=False,
    )
    yield host, options
    stop.set()
    thread.join()
    for t in transports:
        t.close()
    srv.close()


def test_a_session_refused_by_a_dying_host_names_host_action_and_cause(
    dying_server: tuple[Host, SshOptions], tmp_path: Path
) -> None:
    host, options = dying_server
    blob = tmp_path / "blob"
    blob.write_bytes(b"x")
    with SshRunner(host, options) as runner:
        with pytest.raises(HostUnreachable) as ran:
            runner.run(["sha256sum", "--", "/ck/step-00000006/__2_0.distcp"])
        with pytest.raises(HostUnreachable) as put:
            runner.put(blob, "/ck/step-00000006/__2_0.distcp")
    for info, doing in ((ran, "to run 'sha256sum -- /ck/"), (put, "to write /ck/step-")):
        message = str(info.value)
        assert message.startswith(f"host gone-1 (u@127.0.0.1:{host.port}): "), message
        assert doing in message, message
        assert "EOFError: the connection was closed" in message, message
        assert not message.rstrip().endswith(":"), message
