"""`ddpkit slurm` and `ddpkit k8s`: the same training config as `ddpkit train`, as an sbatch script or a PyTorchJob.

Both are local commands: they write or print a job description (and `slurm --submit` hands it to sbatch); the
job itself then runs `python -m ddpkit train` on every node, which joins the launcher like any other run.
"""

from __future__ import annotations

import copy
import json
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddpkit.config import Config, to_dict, to_yaml
from ddpkit.errors import Preempted, UserError

DEFAULT_NAME = "ddpkit"
K8S_PORT = 23456  # the Training Operator's default MASTER_PORT (container port `pytorchjob-port`)
K8S_WORKDIR = "/workspace"
_TIME = re.compile(r"(?:(\d+)-)?(\d{1,3}):([0-5]\d):([0-5]\d)")
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+")


def add_flags(parser) -> None:
    """The job-shape flags of `ddpkit slurm` / `ddpkit k8s` (the parser's prog says which)."""
    g = parser.add_argument_group("job")
    g.add_argument("--nodes", type=int, default=1, metavar="N", help="number of nodes (pods)")
    g.add_argument("--gpus-per-node", type=int, default=1, metavar="G", help="GPUs per node; one rank each")
    if parser.prog.endswith("slurm"):
        g.add_argument(
            "--ntasks-per-node", type=int, metavar="T", help="ranks per node (default: G, or 1 without GPUs)"
        )
        g.add_argument("--cpus-per-task", type=int, metavar="C", help="CPU cores per rank (data loading)")
        g.add_argument("--partition", metavar="P", help="Slurm partition")
        g.add_argument("--time", metavar="HH:MM:SS", help="time limit, [D-]HH:MM:SS")
        g.add_argument(
            "--job-name", default=DEFAULT_NAME, metavar="NAME", help="Slurm job name (%%x in log names)"
        )
        g.add_argument(
            "--signal-before",
            type=int,
            default=120,
            metavar="S",
            help="SIGUSR1 S seconds before the time limit",
        )
        g.add_argument(
            "--output", metavar="FILE", help="stdout log pattern (default: OUT_DIR/slurm/%%x-%%j.out)"
        )
        g.add_argument(
            "--script", metavar="FILE", help="where to write the script (default: OUT_DIR/slurm/NAME.sbatch)"
        )
        g.add_argument(
            "--submit", action="store_true", help="submit the script with sbatch and print the job id"
        )
    else:
        g.add_argument(
            "--image", default="ddpkit:latest", metavar="IMAGE", help="container image with ddpkit installed"
        )
        g.add_argument("--name", default=DEFAULT_NAME, metavar="NAME", help="PyTorchJob name")
        g.add_argument(
            "--pvc", default="ddpkit-runs", metavar="CLAIM", help="PersistentVolumeClaim holding out_dir"
        )


def _check_shape(nodes: int, gpus: int) -> None:
    if nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {nodes}", "use e.g. --nodes 2")
    if gpus < 0:
        raise UserError(
            f"--gpus-per-node must be 0 or more, got {gpus}", "use e.g. --gpus-per-node 8 (0 for CPU nodes)"
        )


def _check_name(flag: str, name: str, pattern: re.Pattern[str], allowed: str) -> None:
    if not pattern.fullmatch(name):
        raise UserError(f"{flag} '{name}' is not a valid name", f"use {allowed}")


def _check_time(limit: str | None, signal_before: int) -> None:
    if not 0 < signal_before <= 65535:
        raise UserError(
            f"--signal-before must be 1..65535 seconds, got {signal_before}", "use e.g. --signal-before 120"
        )
    if limit is None:
        return
    m = _TIME.fullmatch(limit)
    if not m:
        raise UserError(
            f"--time '{limit}' is not a time limit", "write HH:MM:SS or D-HH:MM:SS, e.g. --time 04:00:00"
        )
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if signal_before >= total:
        raise UserError(
            f"--signal-before {signal_before} is not shorter than --time {limit} ({total} s): the warning would come "
            "as the job starts",
            f"use a --signal-before below {total}, e.g. {max(total // 10, 1)}, or a longer --time",
        )


def directive(value: str) -> str:
    """A #SBATCH value as sbatch's directive parser reads it: in double quotes (with \\ and \" escaped) when it
    holds white space, a quote, a backslash or a '#' (which would start a comment)."""
    if "\n" in value or "\r" in value:
        raise UserError(f"{value!r} cannot be an sbatch directive: it holds a line break", "choose another path")
    if re.search(r"[\s\"'\\#]", value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _tasks_per_node(gpus: int, ntasks: int | None) -> int:
    if ntasks is None:
        return max(gpus, 1)
    if ntasks < 1:
        raise UserError(f"--ntasks-per-node must be at least 1, got {ntasks}", "use e.g. --ntasks-per-node 2")
    if gpus and ntasks > gpus:
        raise UserError(
            f"--ntasks-per-node {ntasks} is more than --gpus-per-node {gpus}: each rank needs a GPU of its own",
            f"use --ntasks-per-node {gpus} (or leave it out)",
        )
    return ntasks


def sbatch_script(
    cfg: Config,
    *,
    config_path: Path,
    nodes: int,
    gpus: int,
    ntasks: int,
    log: Path,
    job_name: str = DEFAULT_NAME,
    cpus_per_task: int | None = None,
    partition: str | None = None,
    time_limit: str | None = None,
    signal_before: int = 120,
    python: str = sys.executable,
    workdir: Path | None = None,
) -> str:
    """An sbatch script: one Slurm task per rank, each running `ddpkit train -c CONFIG`; requeued at the time limit."""
    err = log.with_suffix(".err") if log.suffix == ".out" else Path(f"{log}.err")
    directives = [
        f"--job-name={job_name}",
        f"--nodes={nodes}",
        f"--ntasks-per-node={ntasks}",
        *([f"--gres=gpu:{gpus}"] if gpus else []),
        *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else []),
        *([f"--partition={directive(partition)}"] if partition else []),
        *([f"--time={time_limit}"] if time_limit else []),
        f"--chdir={directive(str(workdir or Path.cwd()))}",
        f"--output={directive(str(log))}",
        f"--error={directive(str(err))}",
        "--open-mode=append",
        f"--signal=B:USR1@{signal_before}",
        "--requeue",
    ]
    world, code = nodes * ntasks, Preempted.exit_code
    lines = [
        "#!/bin/bash",
        f"# Written by `ddpkit slurm`: {nodes} node(s) x {ntasks} task(s) = {world} rank(s), one Slurm task per rank.",
        "# Readable and editable: change what you like, then submit it with sbatch.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        f"# Training config (out_dir={cfg.out_dir}): change it there, or add KEY=VALUE overrides to the srun line.",
        f"CONFIG={shlex.quote(str(config_path))}",
        f"OUT_DIR={shlex.quote(str(cfg.out_dir))}",
        f'PYTHON="${{PYTHON:-{python}}}"',
        'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"',
        "",
        f"# {signal_before} s before the time limit Slurm sends SIGUSR1 to this script (--signal=B:...), which passes it",
        f"# on to every rank through srun: each one checkpoints at the next step boundary and exits {code}.",
        "signalled=0 woke=0 step=",
        "on_usr1() {",
        "    signalled=1 woke=1",
        f'    echo "ddpkit: SIGUSR1 ({signal_before} s before the time limit): every rank checkpoints and stops" >&2',
        '    if [ -n "$step" ]; then kill -USR1 "$step" 2>/dev/null; fi',
        "}",
        "trap on_usr1 USR1",
        "",
        "# Every task is one rank: ddpkit reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_STEP_NODELIST;",
        "# the first node is the master, the port is derived from the job id (set MASTER_PORT to choose one).",
        f"# --kill-on-bad-exit=0: a rank that exits {code} after the checkpoint must not get the others killed first.",
        'srun --kill-on-bad-exit=0 "$PYTHON" -m ddpkit train -c "$CONFIG" &',
        "step=$!",
        'if [ "$signalled" = 1 ]; then kill -USR1 "$step" 2>/dev/null; fi  # it came while srun started',
        "status=",
        'while [ -z "$status" ]; do',
        '    woke=0; wait "$step"; rc=$?',
        '    if [ "$woke" = 1 ] && [ "$rc" -gt 128 ]; then continue; fi  # the trap cut the wait short',
        "    status=$rc",
        "done",
        "",
        "# Stopped at the time-limit signal: back into the queue; the next run resumes from out_dir (checkpoint.resume=auto).",
        'if [ "$signalled" = 1 ] && [ "$status" -ne 0 ]; then',
        '    if [ -f "$OUT_DIR/checkpoints/last.pt" ]; then',
        '        from="from its last checkpoint"',
        "    else",
        '        from="from the start (the signal came before the first checkpoint)"',
        "    fi",
        '    echo "ddpkit: requeue $((${SLURM_RESTART_COUNT:-0} + 1)) of job $SLURM_JOB_ID (the ranks exited $status at the time-limit signal): the next run continues $from" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _submit(script: Path) -> str:
    """`sbatch SCRIPT` -> the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError(
            "sbatch is not installed here", f"run on a Slurm login node, or submit later: sbatch {script}"
        )
    proc = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise UserError(f"sbatch refused {script}: {why}", "fix the script or the flags and submit again")
    return proc.stdout.strip().split(";")[0]


def slurm_command(cfg: Config, args) -> int:
    """Write (and with --submit, submit) the sbatch script for N nodes x G GPUs; print it."""
    _check_shape(args.nodes, args.gpus_per_node)
    ntasks = _tasks_per_node(args.gpus_per_node, args.ntasks_per_node)
    _check_time(args.time, args.signal_before)
    _check_name("--job-name", args.job_name, _SLURM_NAME, "letters, digits, '.', '_' and '-'")
    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        raise UserError(
            f"--cpus-per-task must be at least 1, got {args.cpus_per_task}", "use e.g. --cpus-per-task 8"
        )
    script = Path(args.script or Path(cfg.out_dir) / "slurm" / f"{args.job_name}.sbatch").absolute()
    if script.is_dir():
        raise UserError(f"--script '{script}' is a folder", "name a file, e.g. --script job.sbatch")
    # sbatch expands %-patterns in log names: a % of the folder itself must be written %%
    log = Path(args.output or str(script.parent).replace("%", "%%") + "/%x-%j.out").absolute()
    config_path = script.with_suffix(".yaml")
    text = sbatch_script(
        cfg,
        config_path=config_path,
        nodes=args.nodes,
        gpus=args.gpus_per_node,
        ntasks=ntasks,
        log=log,
        job_name=args.job_name,
        cpus_per_task=args.cpus_per_task,
        partition=args.partition,
        time_limit=args.time,
        signal_before=args.signal_before,
    )
    for folder in {script.parent, Path(args.output or script).absolute().parent}:
        folder.mkdir(parents=True, exist_ok=True)
    config_path.write_text(to_yaml(cfg), encoding="utf-8")
    script.write_text(text, encoding="utf-8")
    script.chmod(0o755)
    print(text, end="", flush=True)
    print(f"# wrote {script} and {config_path}", flush=True)
    if args.submit:
        print(f"Submitted batch job {_submit(script)}", flush=True)
    return 0


def _overrides(cfg: Config) -> list[str]:
    """KEY=VALUE for every setting that differs from the defaults (so the pod needs no config file)."""
    import yaml

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    defaults, values = flat(to_dict(Config())), flat(to_dict(cfg))
    items = []
    for key, value in values.items():
        if value != defaults[key]:
            plain = isinstance(value, str) and value != "" and yaml.safe_load(value) == value
            items.append(f"{key}={value if plain else json.dumps(value)}")
    return items


def pytorchjob_manifest(
    cfg: Config, *, nodes: int, gpus: int, image: str, name: str, pvc: str
) -> dict[str, Any]:
    """A Kubeflow PyTorchJob: one Master pod and N-1 Worker pods, each running G ranks of `ddpkit train`."""
    nproc = max(gpus, 1)
    train = ["python", "-m", "ddpkit", "train", *_overrides(cfg), "--nproc-per-node", str(nproc)]
    # The Training Operator sets RANK = pod index and WORLD_SIZE = pods; ddpkit starts G workers per pod from them.
    launch = f'--nnodes {nodes} --node-rank "$RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"'
    command = ["/bin/sh", "-c", f"exec {shlex.join(train)} {launch}"]
    run_dir = posixpath.normpath(
        posixpath.join(K8S_WORKDIR, posixpath.dirname(posixpath.normpath(cfg.out_dir)))
    )
    container: dict[str, Any] = {
        "name": "pytorch",  # the Training Operator finds the training container by this name
        "image": image,
        "workingDir": K8S_WORKDIR,
        "command": command,
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": "pytorchjob-port", "containerPort": K8S_PORT}],
        "volumeMounts": [{"name": "runs", "mountPath": run_dir}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    volumes = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": pvc}},
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory"},
        },  # data-loader workers share batches through /dev/shm
    ]

    def replica(count: int) -> dict[str, Any]:  # each replica its own copy, so YAML shows no anchors
        return copy.deepcopy(
            {
                "replicas": count,
                "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [container], "volumes": volumes}},
            }
        )

    specs = {"Master": replica(1)}
    if nodes > 1:
        specs["Worker"] = replica(nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"pytorchReplicaSpecs": specs},
    }


def k8s_command(cfg: Config, args) -> int:
    """Print a Kubeflow PyTorchJob manifest for N pods x G GPUs."""
    import yaml

    _check_shape(args.nodes, args.gpus_per_node)
    _check_name(
        "--name",
        args.name,
        _K8S_NAME,
        "lower-case letters, digits and '-' (at most 63), e.g. --name digits-ddp",
    )
    _check_name(
        "--pvc", args.pvc, _K8S_NAME, "the name of an existing PersistentVolumeClaim, e.g. --pvc ddpkit-runs"
    )
    if not args.image.strip() or any(c.isspace() for c in args.image):
        raise UserError(
            f"--image '{args.image}' is not an image reference",
            "use e.g. --image registry.example.com/ddpkit:0.1",
        )
    manifest = pytorchjob_manifest(
        cfg, nodes=args.nodes, gpus=args.gpus_per_node, image=args.image, name=args.name, pvc=args.pvc
    )
    ranks = args.nodes * max(args.gpus_per_node, 1)
    print(
        f"# Written by `ddpkit k8s`: {args.nodes} pod(s) x {max(args.gpus_per_node, 1)} rank(s) = {ranks} rank(s).\n"
        f"# Needs the Kubeflow Training Operator and a ReadWriteMany PersistentVolumeClaim '{args.pvc}'.\n"
        "# Apply with: kubectl apply -f FILE",
        flush=True,
    )
    print(yaml.safe_dump(manifest, sort_keys=False, width=1 << 16), end="", flush=True)
    return 0
