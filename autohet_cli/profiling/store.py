"""Several profile files as one Profile, and lookups into it (pure but for reading files).

Files merge in the order given with ``Profile.merged_with``: a later file wins per
entry and per device, except that an analytic entry never replaces a measured
or imported one. A directory stands for its ``*.yaml`` files in name order.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from autohet_cli.errors import ProfileError
from autohet_cli.estimates.profile import EntryKey, Profile, ProfileEntry
from autohet_cli.estimates.profile_io import entry_header, entry_order, load_profile


def merge_profiles(profiles: Iterable[Profile]) -> Profile:
    merged = Profile()
    for p in profiles:
        merged = merged.merged_with(p)
    return merged


def profile_files(paths: Iterable[str | Path]) -> list[Path]:
    """``paths`` with each directory replaced by its ``*.yaml`` files, sorted."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        files += sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    return files


def load_profiles(paths: Iterable[str | Path]) -> Profile:
    files = profile_files(paths)
    if not files:
        raise ProfileError("no profile files given (a directory given holds no *.yaml)")
    return merge_profiles(load_profile(f) for f in files)


def select_entries(
    profile: Profile,
    *,
    model: str | None = None,
    gpu_type: str | None = None,
    tensor_parallel: int | None = None,
    micro_batch_size: int | None = None,
) -> list[ProfileEntry]:
    """Entries matching every filter given, sorted by key."""
    wanted = {
        "model": model,
        "gpu_type": gpu_type,
        "tensor_parallel": tensor_parallel,
        "micro_batch_size": micro_batch_size,
    }
    return [
        profile.entries[k]
        for k in sorted(profile.entries, key=entry_order)
        if all(v is None or getattr(k, name) == v for name, v in wanted.items())
    ]


def find_entry(profile: Profile, key: EntryKey) -> ProfileEntry:
    """The entry for ``key``; the error lists the (tp, mbs) pairs that exist instead."""
    entry = profile.entry(key)
    if entry is not None:
        return entry
    have = tp_mbs_pairs(profile, key.model, key.gpu_type, key.seq_len)
    listed = ", ".join(f"tp {tp} mbs {mbs}" for tp, mbs in have) or "none"
    raise ProfileError(
        f"no profile for {key.model} on {key.gpu_type} at tp {key.tensor_parallel}, "
        f"mbs {key.micro_batch_size}, seq_len {key.seq_len}; profiled: {listed}"
    )


def tp_mbs_pairs(
    profile: Profile, model: str, gpu_type: str, seq_len: int | None = None
) -> list[tuple[int, int]]:
    return sorted(
        (k.tensor_parallel, k.micro_batch_size)
        for k in profile.entries
        if k.model == model and k.gpu_type == gpu_type and seq_len in (None, k.seq_len)
    )


def entry_totals(entry: ProfileEntry) -> dict[str, Any]:
    """One line of ``autohet profile show``: the key, and sums over the layers."""
    return {
        **entry_header(entry),
        "num_layers": len(entry.layers),
        "fwd_ms": sum(lt.fwd_ms for lt in entry.layers),
        "bwd_ms": sum(lt.bwd_ms for lt in entry.layers),
        "update_ms": sum(lt.update_ms for lt in entry.layers),
        "num_params": sum(lt.num_params for lt in entry.layers),
    }
