"""What ``--init-from`` and ``--data`` hold, checked on each host before any worker starts.

The preflight (``launch.preflight``) finds each path readable; the workers then
read what is in it, seconds later and behind torchrun's start-up: a HuggingFace
directory of another model (another hidden size) stopped the launch after 17 s,
its reason 45 lines into torchrun's traceback. One short program per host (its
interpreter, one round trip, no torch) reads instead:

- ``--init-from``: the directory's ``config.json``, read there and parsed here by
  ``hfconfig``, against the plan's model, field by field as the runtime's own
  check does (``hfconfig.differences``: hidden size, layers, heads, vocabulary...);
  then its safetensors headers, read there by the host's ``runtime.hf_files``, and
  here their names, shapes and dtypes against the whole model
  (``runtime.hf_match.check_headers``, the workers' own check; not for a
  ``--model-fn``, whose names are its own);
- ``--data``: the token file opened and its ids checked against the model's
  vocabulary by the host's own ``autohet_cli.dataset`` (numpy only), as the
  workers will; then, here, the rules ``runtime.data_api`` applies before
  training (a headerless file and a vocabulary over uint16, fewer tokens than
  one sample). With a ``--model-fn`` the model's vocabulary is not known: the
  file is only opened. A host without autohet (a user script) is not asked.

Every problem on every host is one error, each naming host, flag and path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autohet_cli.cluster import Host, python_for
from autohet_cli.errors import AutohetError, CommandTimeout
from autohet_cli.hfconfig import differences, parse_hf_config
from autohet_cli.launch import pathargs
from autohet_cli.launch.pathargs import HostPaths, PathArg
from autohet_cli.launch.preflight import PreflightError
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.plan import Plan
from autohet_cli.runtime.worker_defaults import DEFAULT_MODEL_FN
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

TIMEOUT_S = 120.0  # a token file up to 1e8 ids is scanned whole (about a second)
UINT16_IDS = 65536
_MARK = "__autohet_inputs__ "
# argv: the host's workdir (may start with ~), then JSON {"init_from": DIR, "data":
# PATH, "dtype": NAME, "vocab": N}, each optional.
_PROGRAM = r"""
import json, os, sys
workdir = os.path.expanduser(sys.argv[1])
if os.path.isdir(workdir):
    sys.path.insert(0, workdir)
req, out = json.loads(sys.argv[2]), {}
if req.get("init_from"):
    path = os.path.join(os.path.expanduser(req["init_from"]), "config.json")
    out["config_path"] = path
    try:
        if not os.path.isfile(path):
            raise OSError("not a regular file")
        with open(path, "rb") as f:
            out["config"] = f.read(16 << 20).decode("utf-8", "replace")
    except OSError as exc:
        out["config_error"] = exc.strerror or str(exc)
    if req.get("tensors") and "config" in out:
        try:
            from pathlib import Path
            from autohet_cli.runtime.hf_files import HFWeightsError, scan
        except ImportError as exc:
            out["tensors_skipped"] = str(exc)
        else:
            try:
                found = scan(Path(os.path.expanduser(req["init_from"])))
                out["tensors"] = {n: [e.file, e.dtype, list(e.shape)] for n, e in found.items()}
            except HFWeightsError as exc:
                out["tensors_error"] = str(exc)
if req.get("data"):
    try:
        from pathlib import Path
        from autohet_cli.dataset import DataError
        from autohet_cli.dataset.formats import open_tokens
        from autohet_cli.dataset.vocab import check_token_ids
    except ImportError as exc:
        out["data_skipped"] = str(exc)
    else:
        try:
            source = open_tokens(Path(os.path.expanduser(req["data"])), dtype=req.get("dtype"))
            out["data"] = {"path": str(source.path), "kind": source.kind,
                           "num_tokens": source.num_tokens}
            if req.get("vocab"):
                check_token_ids(source, int(req["vocab"]))
        except DataError as exc:
            out["data_error"] = str(exc)
print("__autohet_inputs__ " + json.dumps(out))
"""


def check_inputs(
    pool: HostPool,
    plan: Plan,
    paths: Mapping[str, HostPaths],
    train_args: Sequence[str],
    *,
    timeout_s: float = TIMEOUT_S,
) -> None:
    """Raise one ``PreflightError`` naming every host whose ``--init-from`` or ``--data``
    the workers would refuse; hosts with neither are not asked."""
    spec = _plan_model(plan)
    custom_model = _last(train_args, "--model-fn") not in (None, DEFAULT_MODEL_FN)
    vocab = None if custom_model or spec is None else spec.vocab_size
    wanted = {h: _wanted(hp) for h, hp in paths.items()}
    asked = [pool.host(h) for h, w in wanted.items() if w]
    if not asked:
        return

    def ask(host: Host) -> list[str]:
        init, data = wanted[host.name].get("--init-from"), wanted[host.name].get("--data")
        request = {
            "init_from": init.path if init else None,
            "tensors": not custom_model,  # a --model-fn's names are its own
            "data": data.path if data else None,
            "dtype": _last(train_args, "--data-dtype"),
            "vocab": vocab,
        }
        info = _answer(pool, host, request, timeout_s)
        found = _init_problems(host, init, info, spec) if init else []
        seq_len = plan.training.seq_len
        return found + (_data_problems(host, data, info, vocab, seq_len, request) if data else [])

    results = fan_out(asked, ask)
    problems = [p for r in results.values() for p in ([str(r)] if isinstance(r, Exception) else r)]
    if problems:
        raise PreflightError("; ".join(problems))


def _plan_model(plan: Plan) -> ModelSpec | None:
    if plan.architecture is not None:
        return plan.architecture
    try:
        return get_model(plan.model_name)
    except AutohetError:  # an old plan of a model this version does not know: not checked
        return None


def _wanted(hp: HostPaths) -> dict[str, PathArg]:
    """The host's ``--init-from`` and ``--data`` (a token file, not a --data-fn's path)."""
    return {
        a.flag: a
        for a in hp.paths
        if (a.flag, a.kind) in (("--init-from", "hf_dir"), ("--data", "data"))
    }


def _last(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``args`` (argparse keeps the last)."""
    value = None
    for i, token in enumerate(args):
        name, eq, rest = token.partition("=")
        if name == flag:
            value = rest if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def _answer(
    pool: HostPool, host: Host, request: Mapping[str, Any], timeout_s: float
) -> dict[str, Any]:
    argv = [python_for(host), "-c", _PROGRAM, host.workdir, json.dumps(request)]
    try:
        res = pool.runner(host.name).run(argv, timeout_s=timeout_s)
    except CommandTimeout:
        raise PreflightError(
            f"{host.name}: reading --init-from/--data took over {timeout_s:.0f} s "
            "(a slow network file system?)"
        ) from None
    line = next((x for x in res.stdout.splitlines() if x.startswith(_MARK)), None)
    if line is None:
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:]) or "no output"
        raise PreflightError(
            f"{host.name}: the check of --init-from/--data did not run (exit {res.exit_code}): "
            f"{tail}"
        )
    info: dict[str, Any] = json.loads(line[len(_MARK) :])
    return info


def _init_problems(
    host: Host, arg: PathArg, info: Mapping[str, Any], spec: ModelSpec | None
) -> list[str]:
    where = str(info.get("config_path", f"{arg.path}/config.json"))
    if "config_error" in info:
        return [pathargs.problem(arg, host, f"{where}: {info['config_error']}", arg.path)]
    if spec is None or "config" not in info:
        return []
    try:
        theirs = parse_hf_config(str(info["config"]).encode(), where)
    except AutohetError as exc:
        return [pathargs.problem(arg, host, str(exc), arg.path)]
    diffs = differences(spec, theirs)
    if not diffs:
        return _tensor_problems(host, arg, info, spec)
    what = (
        f"its config.json does not describe the plan's model {spec.name!r} "
        f"({'; '.join(diffs)}); pass the directory of the plan's model, or plan with "
        f"--model {where}"
    )
    return [pathargs.problem(arg, host, what, arg.path)]


def _tensor_problems(
    host: Host, arg: PathArg, info: Mapping[str, Any], spec: ModelSpec
) -> list[str]:
    """The weights' names, shapes and dtypes (the host's safetensors headers) against
    the model, as every worker checks them before it reads a tensor."""
    if "tensors_error" in info:
        return [pathargs.problem(arg, host, str(info["tensors_error"]), arg.path)]
    if not isinstance(info.get("tensors"), dict):
        return []  # no autohet there to read them with: the workers' own check stands
    from autohet_cli.runtime.hf_files import HFWeightsError, TensorEntry
    from autohet_cli.runtime.hf_match import check_headers  # torch: only with --init-from

    tensors = {
        name: TensorEntry(file=str(file), dtype=str(dtype), shape=tuple(int(d) for d in shape))
        for name, (file, dtype, shape) in info["tensors"].items()
    }
    where = Path(str(info.get("config_path", arg.path))).parent
    try:
        check_headers(where, tensors, spec)
    except HFWeightsError as exc:
        return [pathargs.problem(arg, host, str(exc), arg.path)]
    return []


def _data_problems(
    host: Host,
    arg: PathArg,
    info: Mapping[str, Any],
    vocab: int | None,
    seq_len: int,
    request: Mapping[str, Any],
) -> list[str]:
    """The host's refusal, else ``runtime.data_api``'s and ``TokenDataset``'s rules."""
    on = f"host {host.name} ({host.address})"
    if "data_error" in info:
        return [f"{on}: {info['data_error']}"]
    data = info.get("data")
    if not isinstance(data, dict):
        return []  # no autohet there to open it with: the workers' own check stands
    path, tokens = data.get("path", arg.path), int(data.get("num_tokens", 0))
    if data.get("kind") == "flat" and request.get("dtype") is None and (vocab or 0) > UINT16_IDS:
        return [
            f"{on}: --data {path}: a headerless token file and a vocabulary of {vocab:,} "
            "ids, more than uint16 holds: pass --data-dtype uint32 (or uint16 if the file "
            "really is 16-bit)"
        ]
    if tokens < seq_len + 1:
        return [
            f"{on}: --data {path}: {tokens} tokens is too few for one sample of seq_len "
            f"{seq_len} (it needs {seq_len + 1}); use more data or a shorter sequence"
        ]
    return []
