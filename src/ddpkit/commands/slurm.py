"""`ddpkit slurm`: an sbatch script that trains on N nodes x T tasks, one Slurm task per rank, requeued at its
time limit; written (and with --submit, submitted) with the same config as `ddpkit train`."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from ddpkit.atomicio import atomic_write
from ddpkit.commands.jobs import DEFAULT_NAME, add_shape_flags, check_name, check_shape
from ddpkit.commands.outputs import MARKER, add_force_flag, check_output
from ddpkit.config import Config, to_yaml
from ddpkit.errors import Preempted, UserError

_TIME = re.compile(r"(?:(\d+)-)?(\d{1,3}):([0-5]\d):([0-5]\d)")
_SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+")


def add_flags(parser) -> None:
    """`ddpkit slurm`'s flags."""
    g = parser.add_argument_group("job")
    add_shape_flags(g)
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
    g.add_argument("--output", metavar="FILE", help="stdout log pattern (default: OUT_DIR/slurm/%%x-%%j.out)")
    g.add_argument(
        "--script", metavar="FILE", help="where to write the script (default: OUT_DIR/slurm/NAME.sbatch)"
    )
    g.add_argument("--submit", action="store_true", help="submit the script with sbatch and print the job id")
    add_force_flag(g)


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
            f"--signal-before {signal_before} is not shorter than --time {limit} ({total} s): the warning would "
            "come at the start",
            f"use a --signal-before below {total}, e.g. {max(total // 10, 1)}, or a longer --time",
        )


def directive(value: str) -> str:
    """A #SBATCH value as sbatch's directive parser reads it: in double quotes (with \\ and \" escaped) when it
    holds white space, a quote, a backslash or a '#' (which would start a comment)."""
    if "\n" in value or "\r" in value:
        raise UserError(
            f"{value!r} cannot be an sbatch directive: it holds a line break", "choose another path"
        )
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
        f"# Written by `ddpkit slurm` ({MARKER}): {nodes} node(s) x {ntasks} task(s) = {world} rank(s), one Slurm task per rank.",
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
        *_srun_and_requeue(code),
    ]
    return "\n".join(lines) + "\n"


def _srun_and_requeue(code: int) -> list[str]:
    """The script's end: srun starts the ranks, the script waits for them (a signal cuts the wait short) and,
    stopped at the time-limit signal, puts the job back into the queue."""
    return [
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
        '    if [ -f "$OUT_DIR/checkpoints/last.pt" ] || [ -d "$OUT_DIR/checkpoints/last.dcp" ]; then',
        '        from="from its last checkpoint"',
        "    else",
        '        from="from the start (the signal came before the first checkpoint)"',
        "    fi",
        '    echo "ddpkit: requeue $((${SLURM_RESTART_COUNT:-0} + 1)) of job $SLURM_JOB_ID (the ranks exited $status at the time-limit signal): the next run continues $from" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]


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
    check_shape(args.nodes, args.gpus_per_node)
    ntasks = _tasks_per_node(args.gpus_per_node, args.ntasks_per_node)
    _check_time(args.time, args.signal_before)
    check_name("--job-name", args.job_name, _SLURM_NAME, "letters, digits, '.', '_' and '-'")
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
    inputs = (getattr(args, "config", None),)
    for path, flag in ((script, "--script"), (config_path, "--script's config")):
        if path.parent.is_dir():  # a folder made below: nothing in it yet
            check_output(path, None, flag, args.force, inputs)
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
    config_text = f"# {MARKER} slurm for {script.name}\n" + to_yaml(cfg)
    atomic_write(config_path, lambda fh: fh.write(config_text.encode("utf-8")))  # replaces a symlink, never
    atomic_write(script, lambda fh: fh.write(text.encode("utf-8")))  # writes through it
    script.chmod(0o755)
    print(text, end="", flush=True)
    print(f"# wrote {script} and {config_path}", flush=True)
    if args.submit:
        print(f"Submitted batch job {_submit(script)}", flush=True)
    return 0
