"""``autohet export`` uses the checkpoint bytes it verified, never a file read again (issue 45,
item 3).

Export hashed ``.metadata`` and the data files, then DCP opened them again by path: in a step
directory others can write, ``.metadata`` swapped between the two ran the attacker's pickle
(``os.system``) on the first try and ended in a traceback, and a data file swapped the same
way exported other weights silently. The swap here comes at the exact moment an attacker
needs: when the original file's sha256 has just been computed (``swap_after_hash``), so the
race is won every time instead of now and then.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from autohet_cli.ckpt.format import (
    KEY_FILE,
    MANIFEST,
    METADATA,
    manifest_from_json,
    signed_manifest_text,
)
from autohet_cli.runtime.hf_export import ExportError, export_hf, open_checkpoint
from autohet_cli.yamlio import sha256_file
from tests.cli import ROOT, run
from tests.hf_reference import dcp_checkpoint, hf_state, tiny_model
from tests.unit.test_hf_export_guard import SPEC, plan_of

DATA = "__0_0.distcp"
# The CLI, with the attacker's swaps armed (``SWAP_AFTER_HASH``: sha256 -> [path, swap-in]).
CLI = """
import json, os, sys
from tests.unit.test_export_toctou import swap_after_hash
swap_after_hash(json.loads(os.environ["SWAP_AFTER_HASH"]))
from autohet_cli.cli.app import main
sys.argv = ["autohet", *sys.argv[1:]]
main()
"""


class _Watched:
    """A sha256 object that tells ``_swap`` each digest it gives out."""

    def __init__(self, h: Any, swaps: dict[str, tuple[str, str]]) -> None:
        self._h, self._swaps = h, swaps

    def update(self, data: Any) -> None:
        self._h.update(data)

    def copy(self) -> _Watched:
        return _Watched(self._h.copy(), self._swaps)

    def hexdigest(self) -> str:
        digest: str = self._h.hexdigest()
        _swap(self._swaps, digest)
        return digest

    def digest(self) -> bytes:
        digest: bytes = self._h.digest()
        _swap(self._swaps, digest.hex())
        return digest

    def __getattr__(self, name: str) -> Any:
        return getattr(self._h, name)


def _swap(swaps: dict[str, tuple[str, str]], digest: str) -> None:
    if digest in swaps:
        path, replacement = swaps.pop(digest)
        os.replace(replacement, path)  # a rename: what anyone who can write the directory does


def swap_after_hash(swaps: dict[str, Any]) -> Any:
    """From now on, the moment a file's original sha256 has been computed, that file is
    replaced by its swap-in, once. Returns the real ``hashlib.sha256``."""
    real = hashlib.sha256
    armed = {sha: (str(path), str(swap_in)) for sha, (path, swap_in) in swaps.items()}
    hashlib.sha256 = lambda *a, **k: _Watched(real(*a, **k), armed)  # type: ignore[assignment]
    return real


class _Evil:
    """What the attacker plants as ``.metadata``: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@dataclasses.dataclass(frozen=True)
class Job:
    step: Path
    plan: Path
    marker: Path
    evil: Path  # a malicious pickle, to be swapped in for .metadata
    tampered: Path  # the same model's data file with other weights, as large as the real one


@pytest.fixture
def job(tmp_path: Path) -> Job:
    ran = plan_of(SPEC, tmp_path / "ran")
    step = dcp_checkpoint(
        tiny_model(), tmp_path / "ckpt" / "job", plan="lab.v1", plan_sha256=sha256_file(ran)
    )
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.metadata"
    evil.write_bytes(pickle.dumps(_Evil(marker)))
    other = tiny_model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other_step = dcp_checkpoint(other, tmp_path / "other" / "job")
    tampered = tmp_path / "tampered.distcp"
    shutil.copyfile(other_step / DATA, tampered)
    assert tampered.stat().st_size == (step / DATA).stat().st_size
    assert sha256_file(tampered) != sha256_file(step / DATA)
    return Job(step=step, plan=ran, marker=marker, evil=evil, tampered=tampered)


@pytest.fixture
def restore_sha256() -> Iterator[None]:
    real = hashlib.sha256
    yield
    hashlib.sha256 = real  # type: ignore[assignment]


def exported_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def assert_original_weights(out: Path) -> None:
    want = hf_state(SPEC)
    got = exported_weights(out)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def autohet(*args: str, swaps: dict[str, Any], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
        "SWAP_AFTER_HASH": json.dumps({k: [str(p), str(s)] for k, (p, s) in swaps.items()}),
    }
    return run([sys.executable, "-c", CLI, *args], cwd=cwd, env=env, timeout=300)


def export_despite_swaps(job: Job, out: Path, swaps: dict[str, Any], cwd: Path) -> None:
    """``autohet export`` of the job's step to ``out`` with ``swaps`` armed: it ran no
    attacker's code, raised nothing and exported."""
    res = autohet(
        "export", str(job.step), "--out", str(out), "--plan", str(job.plan),
        swaps=swaps, cwd=cwd,
    )  # fmt: skip
    output = res.stdout + res.stderr
    assert not job.marker.exists(), "the attacker's pickle ran"
    assert "Traceback" not in output, output[-3000:]
    assert res.returncode == 0, output[-3000:]


def test_metadata_swapped_after_its_hash_runs_no_code(job: Job, tmp_path: Path) -> None:
    """The reproduction, through the real entry point: on the old code the marker was
    made (the attacker's ``os.system`` ran) and export ended in a traceback. Now the
    swapped-in file is never read: export unpickles the bytes it hashed and succeeds with
    the checkpoint's own weights."""
    out = tmp_path / "hf"
    evil = job.evil.read_bytes()
    swaps = {sha256_file(job.step / METADATA): (job.step / METADATA, job.evil)}
    export_despite_swaps(job, out, swaps, tmp_path)
    assert (job.step / METADATA).read_bytes() == evil  # the swap did happen
    assert_original_weights(out)


def test_a_data_file_swapped_after_its_hash_exports_the_verified_weights(
    job: Job, tmp_path: Path, restore_sha256: None
) -> None:
    """On the old code DCP read the swapped-in file: every weight +1, silently."""
    tampered = job.tampered.read_bytes()
    real = swap_after_hash({sha256_file(job.step / DATA): (job.step / DATA, job.tampered)})
    out = tmp_path / "hf"
    try:
        export_hf(open_checkpoint(job.step), SPEC, out)
    except ExportError as exc:  # refusing is as good as using the verified bytes
        assert DATA in str(exc)
        assert not out.exists()
        return
    finally:
        hashlib.sha256 = real  # type: ignore[assignment]
    assert (job.step / DATA).read_bytes() == tampered  # the swap did happen
    assert_original_weights(out)


def test_both_swapped_at_once_through_the_cli(job: Job, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    swaps = {
        sha256_file(job.step / METADATA): (job.step / METADATA, job.evil),
        sha256_file(job.step / DATA): (job.step / DATA, job.tampered),
    }
    export_despite_swaps(job, out, swaps, tmp_path)
    assert_original_weights(out)


def test_a_data_file_changed_before_export_is_refused_by_name(job: Job, tmp_path: Path) -> None:
    """Same size, other bytes: found when the file is read, named, and nothing is left
    behind (no output, no temporary copy); exit 1 and one error line, no traceback."""
    shutil.copyfile(job.tampered, job.step / DATA)
    out = tmp_path / "hf"
    res = autohet(
        "export", str(job.step), "--out", str(out), "--plan", str(job.plan),
        swaps={}, cwd=tmp_path,
    )  # fmt: skip
    output = res.stdout + res.stderr
    assert res.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and str(job.step / DATA) in lines[-1], lines[-1]
    assert "corrupt" in lines[-1] and MANIFEST in lines[-1], lines[-1]
    assert not out.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_metadata_as_a_symlink_is_refused(job: Job, tmp_path: Path) -> None:
    """Even to a file with the right bytes: checkpoint files are the step directory's own."""
    real = tmp_path / "real.metadata"
    shutil.copyfile(job.step / METADATA, real)
    (job.step / METADATA).unlink()
    (job.step / METADATA).symlink_to(real)
    with pytest.raises(ExportError, match="symbolic link"):
        open_checkpoint(job.step)


def test_a_data_file_as_a_symlink_is_refused(job: Job, tmp_path: Path) -> None:
    ckpt = open_checkpoint(job.step)
    real = tmp_path / "real.distcp"
    shutil.copyfile(job.step / DATA, real)
    (job.step / DATA).unlink()
    (job.step / DATA).symlink_to(real)
    with pytest.raises(ExportError, match="symbolic link"):
        export_hf(ckpt, SPEC, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_metadata_that_verifies_but_names_other_code_is_not_unpickled(job: Job) -> None:
    """With the job key (stolen, or a bug in a writer) the manifest can vouch for any
    ``.metadata``; export unpickles only DCP's metadata classes, so it still runs nothing."""
    key = (job.step.parent / KEY_FILE).read_bytes()
    manifest = manifest_from_json((job.step / MANIFEST).read_text(), MANIFEST)
    shutil.copyfile(job.evil, job.step / METADATA)
    files = tuple(
        dataclasses.replace(f, sha256=sha256_file(job.evil), num_bytes=job.evil.stat().st_size)
        if f.path == METADATA
        else f
        for f in manifest.files
    )
    resigned = dataclasses.replace(manifest, files=files)
    (job.step / MANIFEST).write_text(signed_manifest_text(resigned, key))
    with pytest.raises(ExportError, match=r"posix\.system|os\.system") as info:
        open_checkpoint(job.step)
    assert str(job.step / METADATA) in str(info.value)
    assert not job.marker.exists()


def test_a_key_swapped_after_its_check_is_not_read(
    job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job key is the trust root: read by path after an ``lstat`` by path, a key
    renamed into place in between was the attacker's, and every manifest they signed with
    it verified. Now it is checked and read through one ``O_NOFOLLOW`` descriptor."""
    from autohet_cli.ckpt.files import CheckpointError, read_key

    key_path = job.step.parent / KEY_FILE
    theirs = tmp_path / "their-key"
    theirs.write_bytes(b"k" * 32)
    theirs.chmod(0o600)
    real_lstat = Path.lstat

    def lstat_then_swap(self: Path, *args: Any, **kwargs: Any) -> os.stat_result:
        st = real_lstat(self, *args, **kwargs)
        if self == key_path and not os.path.islink(self):
            link = tmp_path / "link"
            link.symlink_to(theirs)
            os.replace(link, key_path)
        return st

    monkeypatch.setattr(Path, "lstat", lstat_then_swap)
    with pytest.raises(CheckpointError, match="not a regular file of yours"):
        read_key(job.step.parent)
