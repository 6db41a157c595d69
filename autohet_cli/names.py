"""Rules for host names and remote directories read from cluster files and plans (pure).

Host names become file and directory names (``<run>/<host>.log``, per-host
checkpoint folders) and arguments of commands run on hosts, so a name with
``/`` or a leading ``.`` would escape its folder and one with a leading ``-``
would be read as an option. An address is what ssh,
the rendezvous and the recovery transfers connect to: one starting with ``-``
(``-oProxyCommand=...``) would be an option of ssh, one with a space or ``;`` a
second word or command. Directories on hosts are created with ``mkdir``
in the login shell of the training user: a relative path lands wherever that
shell starts, and ``~user`` (or a quoted ``~``) is not what the file says.
"""

from __future__ import annotations

import re

from autohet_cli.errors import ConfigError

# Letters, digits, '.', '_' and '-', starting with a letter or digit: every
# DNS name and IP address fits, and nothing that is a path or an option does.
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Host names end up in file names (255 bytes on Linux) with a suffix.
MAX_HOST_NAME = 128
# A DNS name or an IP address: IPv4, IPv6 (colons, and a %zone for link-local ones).
_ADDRESS = re.compile(r"[A-Za-z0-9:][A-Za-z0-9._:%-]*")
MAX_ADDRESS = 253  # the longest DNS name


def check_host_name(name: str, at: str) -> str:
    """``name`` if it is a valid host name; otherwise a ConfigError naming ``at``."""
    if len(name) > MAX_HOST_NAME or not _HOST_NAME.fullmatch(name):
        raise ConfigError(
            f"{at}: host name {name!r} is not allowed; use letters, digits, '.', '_' and "
            f"'-', starting with a letter or digit (at most {MAX_HOST_NAME} characters)"
        )
    return name


def check_address(address: str, at: str) -> str:
    """``address`` if it is a host name or an IP address; otherwise a ConfigError
    naming ``at`` (a cluster file's ``address``, Slurm's ``NodeAddr``)."""
    if len(address) > MAX_ADDRESS or not _ADDRESS.fullmatch(address):
        shown = address if len(address) <= 80 else address[:77] + "..."
        raise ConfigError(
            f"{at}: {shown!r} is not a host name or an IP address; use letters, digits, "
            "'.', '_', '-' and ':' (IPv6), starting with a letter, digit or ':' "
            "(ssh would take a leading '-' as an option)"
        )
    return address


def check_remote_dir(path: str, at: str) -> str:
    """``path`` if it is absolute, ``~`` or ``~/...`` (expanded on each host)."""
    fix = "write an absolute path (/data/ck) or one under the login's home (~/ck)"
    if any(ord(c) < 32 or c == "\x7f" for c in path):
        raise ConfigError(f"{at}: {path!r} contains control characters; {fix}")
    if path.startswith("-"):
        raise ConfigError(
            f"{at}: {path!r} starts with '-', which mkdir and rm would take as an option; {fix}"
        )
    if path.startswith("/") or path == "~" or path.startswith("~/"):
        return path
    if path.startswith("~"):
        raise ConfigError(f"{at}: {path!r}: another user's home (~user) is not supported; {fix}")
    raise ConfigError(
        f"{at}: {path!r} is relative, so it would depend on where each host's login "
        f"shell starts; {fix}"
    )
