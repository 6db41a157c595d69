"""A named pipe (or another file that is not a regular one) given to ``data prepare`` is
called what it is, not "no such input file" (issue 45, item 7b)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from autohet_cli.dataset import DataError
from autohet_cli.dataset.prepare import PrepareOptions, prepare
from autohet_cli.dataset.readers import expand_inputs


def test_a_fifo_input_is_named_a_named_pipe(tmp_path: Path) -> None:
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError) as caught:
        expand_inputs([fifo])
    message = str(caught.value)
    assert f"{fifo}: is a named pipe (FIFO), not a regular file" in message
    assert "no such" not in message and "save" in message


def test_a_socket_input_is_named_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "s.txt"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(DataError, match=r"s\.txt: is a socket, not a regular file"):
            expand_inputs([path])


def test_a_dangling_link_is_still_no_such_file(tmp_path: Path) -> None:
    link = tmp_path / "gone.txt"
    link.symlink_to(tmp_path / "missing.txt")
    with pytest.raises(DataError, match=r"gone\.txt: no such input file"):
        expand_inputs([link])


def test_a_fifo_tokenizer_is_named_a_named_pipe_without_waiting(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("hello\n")
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    options = PrepareOptions(inputs=(src,), tokenizer=str(fifo), out_dir=tmp_path / "out")
    with pytest.raises(DataError, match=r"tokenizer\.json: is a named pipe \(FIFO\), not a reg"):
        prepare(options)
