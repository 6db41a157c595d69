"""Every test process (and what it starts) keeps autohet's on-disk caches in a
directory of its own, not the user's ``~/.cache`` (``autohet_cli.yamlcache``)."""

from __future__ import annotations

import os
import tempfile

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="autohet-test-cache-")
