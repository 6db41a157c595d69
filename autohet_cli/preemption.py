"""A host's preemption check, as the cluster file states it (pure).

    hosts:
      - name: spot-a100-0
        gpus: {type: A100-40GB, count: 4}
        preemption_check:
          command: curl -sf http://169.254.169.254/latest/meta-data/spot/instance-action
          interval_s: 5

or ``url: http://metadata.google.internal/computeMetadata/v1/instance/preempted``
with ``headers: {Metadata-Flavor: Google}``. ``defaults.preemption_check`` sets it
for every host. Off by default: a host without one still reacts to SIGTERM. What
counts as a notice, and what the workers do then, is ``runtime.preempt``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from autohet_cli.errors import ConfigError
from autohet_cli.yamlio import as_mapping, check_keys, coerce

CHECK_ENV = "AUTOHET_PREEMPTION_CHECK"
DEFAULT_INTERVAL_S = 5.0
MIN_INTERVAL_S = 0.2


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckSpec:
    """How a host announces a coming preemption: a command (exit 0: a notice) or a URL
    (200 with a body other than empty or FALSE: a notice), polled every ``interval_s``."""

    command: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = field(default=())
    interval_s: float = DEFAULT_INTERVAL_S

    def describe(self) -> str:
        return f"command {self.command!r}" if self.command else f"url {self.url}"

    def to_dict(self) -> dict[str, Any]:
        raw: dict[str, Any] = {"interval_s": self.interval_s}
        if self.command:
            raw["command"] = self.command
        if self.url:
            raw["url"] = self.url
        if self.headers:
            raw["headers"] = dict(self.headers)
        return raw

    def to_env(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def check_from_dict(raw: Any, at: str) -> CheckSpec:
    """Parse ``preemption_check`` with errors naming the field."""
    d = as_mapping(raw, at)
    check_keys(d, at, [], ["command", "url", "headers", "interval_s"])
    command = coerce(d["command"], str, f"{at}.command") if d.get("command") is not None else None
    url = coerce(d["url"], str, f"{at}.url") if d.get("url") is not None else None
    if (command is None) == (url is None):
        raise ConfigError(
            f"{at}: give exactly one of command (exit 0 means a notice) or url (HTTP 200 "
            "with a body other than FALSE means a notice)"
        )
    if command is not None and not command.strip():
        raise ConfigError(f"{at}.command: empty")
    if url is not None and not url.startswith(("http://", "https://")):
        raise ConfigError(f"{at}.url: expected an http:// or https:// URL, got {url!r}")
    headers_raw = as_mapping(d.get("headers") or {}, f"{at}.headers")
    if headers_raw and url is None:
        raise ConfigError(f"{at}.headers: only a url check sends headers")
    headers = tuple(
        (str(k), coerce(v, str, f"{at}.headers.{k}")) for k, v in sorted(headers_raw.items())
    )
    interval = (
        coerce(d["interval_s"], float, f"{at}.interval_s")
        if d.get("interval_s") is not None
        else DEFAULT_INTERVAL_S
    )
    if interval < MIN_INTERVAL_S:
        raise ConfigError(f"{at}.interval_s: at least {MIN_INTERVAL_S} s, got {interval}")
    return CheckSpec(command=command, url=url, headers=headers, interval_s=float(interval))


def check_from_env(text: str | None) -> CheckSpec | None:
    """The launcher's ``AUTOHET_PREEMPTION_CHECK`` (JSON of ``to_dict``), or None."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        raise ConfigError(f"${CHECK_ENV} is not JSON: {text[:200]!r}") from None
    return check_from_dict(raw, f"${CHECK_ENV}")
