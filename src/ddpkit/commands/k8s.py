"""`ddpkit k8s`: a Kubeflow PyTorchJob manifest that trains on N pods x G GPUs with the config of `ddpkit train`."""

from __future__ import annotations

import copy
import json
import posixpath
import re
import shlex
from typing import Any

from ddpkit.commands.jobs import DEFAULT_NAME, add_shape_flags, check_name, check_shape
from ddpkit.config import Config, to_dict
from ddpkit.config.schema import shown
from ddpkit.errors import Preempted, UserError

K8S_PORT = 23456  # the Training Operator's default MASTER_PORT (container port `pytorchjob-port`)
K8S_WORKDIR = "/workspace"
K8S_DATA = "/data"  # where the data volume is mounted; data.root in the pods
PREEMPTED_POD_EXIT = 143  # ddpkit's exit 3 (preempted) as the pod reports it: 128 + SIGTERM, retryable
_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def add_flags(parser) -> None:
    """`ddpkit k8s`'s flags."""
    g = parser.add_argument_group("job")
    add_shape_flags(g)
    g.add_argument(
        "--image", default="ddpkit:latest", metavar="IMAGE", help="container image with ddpkit installed"
    )
    g.add_argument("--name", default=DEFAULT_NAME, metavar="NAME", help="PyTorchJob name")
    g.add_argument(
        "--pvc", default="ddpkit-runs", metavar="CLAIM", help="PersistentVolumeClaim holding out_dir"
    )
    g.add_argument(
        "--data-pvc",
        metavar="CLAIM",
        help=f"PersistentVolumeClaim with the data sets, mounted at {K8S_DATA} = data.root (default: --pvc's, "
        "folder data/)",
    )
    g.add_argument("--cpu", metavar="Q", help="CPU cores per pod, requested and limit (e.g. 8 or 7500m)")
    g.add_argument("--memory", metavar="Q", help="memory per pod, requested and limit (e.g. 64Gi)")
    g.add_argument(
        "--backoff-limit",
        type=int,
        default=3,
        metavar="N",
        help="pod restarts before the job is failed (runPolicy.backoffLimit, default 3)",
    )


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


def pod_script(train: list[str], nodes: int) -> str:
    """The pod's shell script: `ddpkit train` on G workers, SIGTERM passed on, exit 3 turned into a retryable 143."""
    # The Training Operator sets RANK = pod index and WORLD_SIZE = pods; ddpkit starts G workers per pod from them.
    launch = f'--nnodes {nodes} --node-rank "$RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"'
    return "\n".join(
        [
            "# This shell is PID 1: it passes SIGTERM (eviction, preemption, kubectl delete) on, so ddpkit checkpoints.",
            "woke=0 pid=",
            """trap 'woke=1; [ -n "$pid" ] && kill -TERM "$pid"' TERM INT""",
            f"{shlex.join(train)} {launch} &",
            "pid=$!",
            '[ "$woke" = 1 ] && kill -TERM "$pid"  # a signal that came before $pid was known',
            'while :; do woke=0; wait "$pid"; code=$?; [ "$woke" = 1 ] && [ "$code" -gt 128 ] || break; done',
            f"# {Preempted.exit_code} = stopped at a step boundary after a checkpoint: exit {PREEMPTED_POD_EXIT} (>= 128), which",
            "# restartPolicy ExitCode restarts, to resume; 2 (a config error) and 1 (a failed worker) end the job.",
            f'if [ "$code" -eq {Preempted.exit_code} ]; then exit {PREEMPTED_POD_EXIT}; fi',
            'exit "$code"',
        ]
    )


def _pod(
    cfg: Config,
    nodes: int,
    gpus: int,
    image: str,
    pvc: str,
    data_pvc: str | None,
    cpu: str | None,
    memory: str | None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every pod's training container and its volumes: the runs' claim, the data, a memory-backed /dev/shm."""
    nproc = max(gpus, 1)
    overrides = [o for o in _overrides(cfg) if not o.startswith("data.root=")] + [f"data.root={K8S_DATA}"]
    train = ["python", "-m", "ddpkit", "train", *overrides, "--nproc-per-node", str(nproc)]
    run_dir = posixpath.normpath(
        posixpath.join(K8S_WORKDIR, posixpath.dirname(posixpath.normpath(cfg.out_dir)))
    )
    data_mount: dict[str, Any] = {"name": "data", "mountPath": K8S_DATA}
    if data_pvc is None or data_pvc == pvc:  # the data sets beside the runs, in the same claim
        data_mount = {"name": "runs", "mountPath": K8S_DATA, "subPath": "data"}
    container: dict[str, Any] = {
        "name": "pytorch",  # the Training Operator finds the training container by this name
        "image": image,
        "workingDir": K8S_WORKDIR,
        "command": ["/bin/sh", "-c", pod_script(train, nodes)],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": "pytorchjob-port", "containerPort": K8S_PORT}],
        "volumeMounts": [
            {"name": "runs", "mountPath": run_dir},
            data_mount,
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    wanted = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v}
    limits = {**wanted, **({"nvidia.com/gpu": gpus} if gpus else {})}
    if limits:
        container["resources"] = {**({"requests": dict(wanted)} if wanted else {}), "limits": limits}
    volumes = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": pvc}},
        *(
            [{"name": "data", "persistentVolumeClaim": {"claimName": data_pvc}}]
            if data_mount["name"] == "data"
            else []
        ),
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory"},
        },  # data-loader workers share batches through /dev/shm
    ]
    return container, volumes


def pytorchjob_manifest(
    cfg: Config,
    *,
    nodes: int,
    gpus: int,
    image: str,
    name: str,
    pvc: str,
    data_pvc: str | None = None,
    cpu: str | None = None,
    memory: str | None = None,
    backoff_limit: int = 3,
) -> dict[str, Any]:
    """A Kubeflow PyTorchJob: one Master pod and N-1 Worker pods, each running G ranks of `ddpkit train`."""
    container, volumes = _pod(cfg, nodes, gpus, image, pvc, data_pvc, cpu, memory)

    def replica(count: int) -> dict[str, Any]:  # each replica its own copy, so YAML shows no anchors
        return copy.deepcopy(
            {
                "replicas": count,
                "restartPolicy": "ExitCode",  # the operator restarts exits >= 128 only: not a config error (2)
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
        "spec": {"runPolicy": {"backoffLimit": backoff_limit}, "pytorchReplicaSpecs": specs},
    }


def _check_quantity(flag: str, value: str | None, example: str) -> None:
    if value is not None and not _QUANTITY.fullmatch(value):
        raise UserError(f"{flag} '{value}' is not a Kubernetes quantity", f"write e.g. {flag} {example}")


def to_yaml_text(manifest: dict[str, Any]) -> str:
    """The manifest as YAML, multi-line strings (the pod script) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump(manifest, Dumper=Dumper, sort_keys=False, width=1 << 16)


def k8s_command(cfg: Config, args) -> int:
    """Print a Kubeflow PyTorchJob manifest for N pods x G GPUs."""
    check_shape(args.nodes, args.gpus_per_node)
    check_name(
        "--name",
        args.name,
        _K8S_NAME,
        "lower-case letters, digits and '-' (at most 63), e.g. --name digits-ddp",
    )
    for flag, claim in (("--pvc", args.pvc), ("--data-pvc", args.data_pvc or args.pvc)):
        check_name(
            flag, claim, _K8S_NAME, f"the name of an existing PersistentVolumeClaim, e.g. {flag} ddpkit-runs"
        )
    _check_quantity("--cpu", args.cpu, "8")
    _check_quantity("--memory", args.memory, "64Gi")
    if args.backoff_limit < 0:
        raise UserError(
            f"--backoff-limit must be 0 or more, got {args.backoff_limit}", "use e.g. --backoff-limit 3"
        )
    if not args.image.strip() or any(c.isspace() for c in args.image):
        raise UserError(
            f"--image {shown(args.image)} is not an image reference",
            "use e.g. --image registry.example.com/ddpkit:0.1",
        )
    manifest = pytorchjob_manifest(
        cfg,
        nodes=args.nodes,
        gpus=args.gpus_per_node,
        image=args.image,
        name=args.name,
        pvc=args.pvc,
        data_pvc=args.data_pvc,
        cpu=args.cpu,
        memory=args.memory,
        backoff_limit=args.backoff_limit,
    )
    ranks = args.nodes * max(args.gpus_per_node, 1)
    print(
        f"# Written by `ddpkit k8s`: {args.nodes} pod(s) x {max(args.gpus_per_node, 1)} rank(s) = {ranks} rank(s).\n"
        f"# Needs the Kubeflow Training Operator and a ReadWriteMany PersistentVolumeClaim '{args.pvc}'.\n"
        f"# Pods exit 2 on a config error (not restarted), {PREEMPTED_POD_EXIT} when preempted after a checkpoint "
        f"(restarted, resumes).\n"
        "# Apply with: kubectl apply -f FILE",
        flush=True,
    )
    print(to_yaml_text(manifest), end="", flush=True)
    return 0
