"""The Slurm backend's pure parts: cluster-file settings, and the batch script that
``autohet launch --backend slurm --dry-run`` prints, checked line for line."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autohet_cli.cluster import cluster_from_dict, cluster_to_dict, load_cluster
from autohet_cli.errors import ConfigError
from autohet_cli.launch.session import LaunchRequest, dry_run
from autohet_cli.plan import Stage, write_plan
from autohet_cli.slurm import nodeport, script
from autohet_cli.slurm.script import components
from autohet_cli.yamlio import sha256_file
from tests.planting import plan_of, stage

ROOT = Path(__file__).resolve().parents[2]

SLURM = {
    "partition": "gpu",
    "account": "lab",
    "time_limit": "04:00:00",
    "cpus_per_gpu": 8,
    "sbatch_args": ["--mem=0"],
    "gpu_types": {"A100-40": {"gres": "a100", "constraint": "a100"}, "V100-16": {"gres": "v100"}},
}


def _cluster(tmp: Path, slurm: dict[str, object] | None = None) -> Path:
    hosts = [
        {"name": "a100-0", "address": "10.0.0.1", "gpus": {"type": "A100-40", "count": 4}},
        {"name": "a100-1", "address": "10.0.0.2", "gpus": {"type": "A100-40", "count": 4}},
        {"name": "v100-0", "address": "10.0.0.3", "gpus": {"type": "V100-16", "count": 8}},
    ]
    doc = {
        "schema": "autohet.cluster/v1",
        "name": "lab",
        "backend": "slurm",
        "slurm": SLURM if slurm is None else slurm,
        "hosts": hosts,
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _plan(tmp: Path, cluster: Path) -> Path:
    """Two pipelines: A100 TP 4 -> A100 TP 4, and one V100 stage on 4 of its 8 GPUs."""

    def st(a: int, b: int, host: str, gpu_type: str) -> Stage:
        return stage(a, b, host, 0, 1, 2, 3, gpu_type=gpu_type)

    plan = plan_of(
        [st(0, 3, "a100-0", "A100-40"), st(3, 6, "a100-1", "A100-40")],
        [st(0, 6, "v100-0", "V100-16")],
        microbatches=(5, 3),
        version=0,
        inputs={"cluster": {"path": str(cluster), "sha256": sha256_file(cluster)}},
    )
    _, path = write_plan(plan, tmp / "plans")
    return path


EXPECTED = """\
#!/bin/bash
# autohet: plan lab.v1 on Slurm, 3 host(s) in 2 heterogeneous component(s):
#   component 0: a100-0, a100-1 (A100-40, 4 GPU(s) each)
#   component 1: v100-0 (V100-16, 4 GPU(s) each)
# Submitted by `autohet launch` as: sbatch --parsable {run}/job.sbatch
#SBATCH --job-name=autohet-lab.v1
#SBATCH --output={run}/slurm/batch-%j.out
#SBATCH --partition=gpu
#SBATCH --account=lab
#SBATCH --time=04:00:00
#SBATCH --nodes=2
#SBATCH --nodelist=a100-0,a100-1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:a100:4
#SBATCH --constraint=a100
#SBATCH --cpus-per-task=32
#SBATCH --signal=TERM@120
#SBATCH --mem=0
#SBATCH hetjob
#SBATCH --partition=gpu
#SBATCH --account=lab
#SBATCH --time=04:00:00
#SBATCH --nodes=1
#SBATCH --nodelist=v100-0
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:v100:4
#SBATCH --cpus-per-task=32
#SBATCH --signal=TERM@120
#SBATCH --mem=0
set -u
run={run}

# On each node (srun runs this file with `node`): this node's torchrun.
if [ "${{1:-}}" = node ]; then
  node="${{SLURMD_NODENAME:-}}"
  # The workdir, where the workers import code from, must be this user's alone
  # (autohet_cli/privatedir.py, the rule checkpoint directories follow).
  check_workdir={check}
{port}
  case "$node" in
{cases}
    *) echo "autohet: node $node is not a host of this plan" >&2; exit 2 ;;
  esac
  # Stay torchrun's parent until it ends: Slurm's TERM would otherwise end this
  # shell first, and proctrack/linuxproc, which follows the process tree, would
  # lose the orphaned torchrun and never kill it. A TERM that Slurm sends to every
  # process of the step (scancel --signal, the time limit's --signal) reaches
  # torchrun too; the one forwarded here is the same notice (runtime.agent).
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null' TERM INT
  while :; do
    wait "$child"; rc=$?
    kill -0 "$child" 2>/dev/null || break
  done
  echo "$rc" > "$run/exit/$node"
  exit $rc
fi

# The batch step: one srun per component, one task (torchrun) per node.
mkdir -p -- "$run/slurm" "$run/exit"
export AUTOHET_LAUNCH_TIME=$(date +%s.%N)
srun --het-group=0 --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 \
--output="$run/slurm/%N.out" --error="$run/slurm/%N.err" bash "$run/job.sbatch" node &
srun --het-group=1 --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 \
--output="$run/slurm/%N.out" --error="$run/slurm/%N.err" bash "$run/job.sbatch" node &
# A component that fails stops the others: its peers could only wait for it.
left=2; rc=0
while [ "$left" -gt 0 ]; do
  wait -n; c=$?; left=$((left - 1))
  if [ "$c" -ne 0 ] && [ "$rc" -eq 0 ]; then
    rc=$c; echo "autohet: a component ended with exit code $c; stopping the others" >&2
    kill $(jobs -p) 2>/dev/null
  fi
done
exit "$rc"
"""

CASE = """\
    {host})
      python3 -S -c "$check_workdir" "$HOME"/autohet || exit 1
      (umask 077 && mkdir -p -- "$HOME"/autohet/checkpoints/lab/J1 && \
chmod 700 -- "$HOME"/autohet/checkpoints/lab/J1 && \
{{ [ -e "$HOME"/autohet/checkpoints/lab/J1/.autohet-key ] || \
cp -- "$run/.job-key" "$HOME"/autohet/checkpoints/lab/J1/.autohet-key; }}) || exit 1
      cd "$HOME"/autohet || exit 1
      env AUTOHET_FAILURE_DOMAIN={domain} AUTOHET_HOST={host} AUTOHET_HOST_ADDR={addr} \
AUTOHET_PLAN={run}/lab.v1.yaml AUTOHET_RUN_DIR={run} PYTHONUNBUFFERED=1 \
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
python3 -m autohet_cli.runtime.agent --nnodes 3 --node-rank {rank} --nproc-per-node 4 \
--master-addr 10.0.0.1 --master-port "$port" --max-restarts 0 -m autohet_cli.runtime.train \
--plan {run}/lab.v1.yaml --run-dir {run} --checkpoint-dir "$HOME"/autohet/checkpoints \
--remote-storage none --job J1 --steps=50 --checkpoint-every=auto --keep-checkpoints=3 &
      ;;"""


def _request(plan: Path, tmp_path: Path) -> LaunchRequest:
    """50 steps of ``plan`` as run r1 of job J1, master port 29411, runs under tmp_path."""
    fixed = {"run_id": "r1", "job": "J1", "master_port": 29411}
    return LaunchRequest(plan_file=plan, steps=50, runs_root=tmp_path / "runs", **fixed)


def test_dry_run_prints_the_exact_batch_script_of_a_three_host_mixed_plan(
    tmp_path: Path,
) -> None:
    plan = _plan(tmp_path, _cluster(tmp_path))
    req = _request(plan, tmp_path)
    run = str((tmp_path / "runs" / "lab.v1" / "r1").resolve())
    cases = "\n".join(
        CASE.format(host=h, rank=i, run=run, addr=f"10.0.0.{i + 1}", domain=f"{t}/on-demand")
        for i, (h, t) in enumerate(
            (("a100-0", "A100-40"), ("a100-1", "A100-40"), ("v100-0", "V100-16"))
        )
    )
    port = "\n".join(nodeport.lines("a100-0", "python3", 29411, fixed=True))
    check = shlex.quote(script._workdir_program())  # run below (test_the_workdir_check)
    expected = EXPECTED.replace("\\\n", "").format(run=run, cases=cases, port=port, check="@C@")
    assert dry_run(req) == expected.replace("@C@", check)
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_the_cli_dry_run_is_the_same_script_and_a_valid_bash_program(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _cluster(tmp_path))
    args = ["--run-id", "r1", "--job", "J1", "--master-port", "29411", "--steps", "50"]
    res = subprocess.run(
        [sys.executable, "-m", "autohet_cli", "launch", str(plan), "--dry-run", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    # Printed first, whatever the launch's checks then say of this machine (its Slurm
    # commands, a run folder under /tmp: slurm.precheck, tested in test_slurm_precheck).
    assert res.returncode == 0 or res.stderr.startswith("error: "), res.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(res.stdout)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    req = _request(plan, tmp_path)
    assert res.stdout == dry_run(req) + "\n"


def test_backend_flag_overrides_the_cluster_file(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    doc = yaml.safe_load(cluster.read_text())
    doc["backend"] = "ssh"
    cluster.write_text(yaml.safe_dump(doc))
    plan = _plan(tmp_path, cluster)
    common = {"plan_file": plan, "run_id": "r1", "job": "J1", "master_port": 29411}
    assert dry_run(LaunchRequest(**common)).startswith("# a100-0 (10.0.0.1), node 0")
    assert dry_run(LaunchRequest(**common, backend="slurm")).startswith("#!/bin/bash")
    with pytest.raises(ConfigError, match="--backend: 'pbs' is not a launch backend"):
        dry_run(LaunchRequest(**common, backend="pbs"))


def test_components_group_hosts_by_type_and_gpus_used_in_plan_order(tmp_path: Path) -> None:
    from autohet_cli.launch.specs import LaunchOptions, build_launch_specs
    from autohet_cli.plan import load_plan

    cl = load_cluster(_cluster(tmp_path))
    plan = load_plan(_plan(tmp_path, tmp_path / "cluster.yaml"))
    specs = build_launch_specs(plan, cl, LaunchOptions(run_id="r", gpus_from_scheduler=True))
    comps = components(specs, cl)
    assert [(c.gpu_type, c.gpus_per_node, c.hosts) for c in comps] == [
        ("A100-40", 4, ("a100-0", "a100-1")),
        ("V100-16", 4, ("v100-0",)),
    ]
    # Slurm picks the GPUs and sets CUDA_VISIBLE_DEVICES: the specs must not fight it.
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs)


def test_settings_round_trip_and_defaults(tmp_path: Path) -> None:
    cl = load_cluster(_cluster(tmp_path))
    assert cl.backend == "slurm" and cl.slurm.partition == "gpu"
    assert cl.slurm.gpu_type("A100-40").constraint == "a100"
    again = cluster_from_dict(cluster_to_dict(cl), "again")
    assert again == cl
    plain = load_cluster(_cluster(tmp_path, slurm={}))
    assert plain.slurm.signal_before_end_s == 120 and plain.slurm.partition is None


@pytest.mark.parametrize(
    ("slurm", "message"),
    [
        ({"partitoin": "gpu"}, "slurm: unknown key 'partitoin'"),
        ({"partition": "gpu\n#SBATCH --uid=0"}, r"slurm\.partition: .*#SBATCH line"),
        ({"account": "a b"}, r"slurm\.account"),
        ({"time_limit": "4 hours"}, r"slurm\.time_limit: '4 hours' is not a Slurm time"),
        ({"sbatch_args": ["--mem=0 --uid=0"]}, r"sbatch_args\[0\]: .*one long option"),
        ({"sbatch_args": ["--nodelist=x"]}, r"sbatch_args\[0\]: .*sets --nodelist itself"),
        ({"gpu_types": {"H100-80": {"gres": "h100"}}}, r"gpu_types\.H100-80: no host"),
        ({"gpu_types": {"A100-40": {"gres": "a100", "typo": 1}}}, r"unknown key 'typo'"),
        ({"gpu_types": {"A100-40": {"constraint": "a100;rm"}}}, r"constraint: .*feature"),
        ({"cpus_per_gpu": 0}, r"cpus_per_gpu: must be at least 1"),
        ({"signal_before_end_s": -1}, r"signal_before_end_s"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(
    tmp_path: Path, slurm: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_cluster(_cluster(tmp_path, slurm=slurm))


def test_an_unknown_backend_in_the_cluster_file_is_refused(tmp_path: Path) -> None:
    path = _cluster(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["backend"] = "kubernetes"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"backend: 'kubernetes' is not a launch backend"):
        load_cluster(path)


# ------------------------------------------------- run directories in the batch script


def _sbatch_words(text: str) -> list[str]:
    """The arguments sbatch reads from the rest of an ``#SBATCH`` line: a port of its own
    reader (``_get_argument`` in Slurm's src/sbatch/opt.c): whitespace separates, ``"`` and
    ``'`` quote, a backslash takes the next character as is, an unquoted ``#`` ends the line."""
    words: list[str] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return words
        word, quote, escaped = "", "", False
        while i < n and (quote or not text[i].isspace()) and text[i] != "\n":
            c = text[i]
            i += 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
                continue
            elif quote:
                if c == quote:
                    quote = ""
                    continue
            elif c in "\"'":
                quote = c
                continue
            elif c == "#":
                i = n
                break
            word += c
        assert not quote, f"sbatch: unmatched {quote} in {text!r}"
        if word:
            words.append(word)


def _slurm_request(tmp_path: Path, runs_root: Path) -> LaunchRequest:
    plan = _plan(tmp_path, _cluster(tmp_path))
    return LaunchRequest(
        plan_file=plan, run_id="r1", job="J1", master_port=29411, runs_root=runs_root
    )


@pytest.mark.parametrize(
    "dirname", ["my project", 'it\'s "q" $HOME `id` #x ;&|<>*?', "proj'; touch PWNED; '"]
)
def test_a_run_dir_with_spaces_quotes_and_dollars_stays_one_path(
    tmp_path: Path, dirname: str
) -> None:
    """sbatch reads the output path whole, and bash runs the batch part in that directory
    (srun faked: it records its arguments) without running anything the path spells."""
    root = tmp_path / dirname / "runs"
    script = dry_run(_slurm_request(tmp_path, root))
    run = str((root / "lab.v1" / "r1").resolve())
    directives = [ln[len("#SBATCH") :] for ln in script.splitlines() if ln.startswith("#SBATCH")]
    outputs = [w for d in directives for w in _sbatch_words(d) if w.startswith("--output")]
    assert outputs == [f"--output={run}/slurm/batch-%j.out"]
    assert all(len(_sbatch_words(d)) == 1 for d in directives)
    submitted = next(ln for ln in script.splitlines() if ln.startswith("# Submitted by"))
    assert shlex.split(submitted.split(" as: ", 1)[1]) == [
        "sbatch",
        "--parsable",
        f"{run}/job.sbatch",
    ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" >> "$SRUN_LOG"\n')
    (bin_dir / "srun").chmod(0o755)
    Path(run).mkdir(parents=True)
    (Path(run) / "job.sbatch").write_text(script)
    log = tmp_path / "srun.log"
    res = subprocess.run(
        ["bash", str(Path(run) / "job.sbatch")],
        cwd=tmp_path,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SRUN_LOG": str(log)},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert (Path(run) / "slurm").is_dir() and (Path(run) / "exit").is_dir()
    assert log.read_text().splitlines().count(f"{run}/job.sbatch") == 2  # one per component
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["bin", "cluster.yaml", "plans", "srun.log", dirname]
    )


@pytest.mark.parametrize(
    ("dirname", "why"),
    [
        ("proj\ntouch PWNED #", "a newline"),
        ("proj\rx", "a carriage return"),
        ("tab\there", "a control character"),
        ("100%done", "'%'"),
        ("back\\slash", "a backslash"),
    ],
)
def test_a_run_dir_no_batch_script_can_hold_is_refused_naming_it(
    tmp_path: Path, dirname: str, why: str
) -> None:
    root = tmp_path / dirname / "runs"
    with pytest.raises(ConfigError) as exc:
        dry_run(_slurm_request(tmp_path, root))
    message = str(exc.value)
    assert why in message and repr(str(root.resolve() / "lab.v1" / "r1")) in message
    assert "\n" not in message


def test_the_cli_refuses_a_working_directory_with_a_newline_before_writing_anything(
    tmp_path: Path,
) -> None:
    plan = _plan(tmp_path, _cluster(tmp_path))
    cwd = tmp_path / "proj\ntouch PWNED #"
    cwd.mkdir()
    for extra in (["--dry-run"], []):
        res = subprocess.run(
            [sys.executable, "-m", "autohet_cli", "launch", str(plan), *extra, "--run-id", "r1"],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            check=False,
            timeout=60,
        )
        assert res.returncode == 1, res.stdout + res.stderr
        assert "Traceback" not in res.stderr and "a newline" in res.stderr
        assert list(cwd.iterdir()) == []  # no runs/ directory, no key, no script
    assert not list(tmp_path.rglob("PWNED"))


def test_the_workdir_check_makes_a_private_workdir_and_refuses_a_shared_one(
    tmp_path: Path,
) -> None:
    """What each node runs before cd-ing into its workdir (``python -S``: nothing of
    ours importable yet): the workdir is created 0700, and one others can write, or
    under a parent they can, stops the node with the reason."""
    program = script._workdir_program()

    def check(path: Path) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-S", "-c", program, str(path)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)

    fresh = tmp_path / "home" / "autohet"
    (tmp_path / "home").mkdir(mode=0o700)
    assert check(fresh).returncode == 0 and (fresh.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    res = check(shared / "autohet")
    assert res.returncode == 1
    assert res.stderr.startswith(f"autohet runtime: error: workdir {shared / 'autohet'} is not")
    assert "writable by you only" in res.stderr
