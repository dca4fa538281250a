"""Every shell command the docs show (README.md, README.zh-CN.md, docs/*.md) is run by a test here, or named as
run by another test, or named as needing what this machine lacks; so a doc cannot drift from the program.

A doc that gains a command nobody classified fails, and so does a mapping whose command left the docs. Every
`ddpkit ...` line, whatever its class, is parsed the way the CLI parses it (flags, config keys and values,
launch flags), and so is every `ddpkit CMD --flag ...` span of the prose; every `make` line is checked to be
a target of the Makefile. `python tests/test_doc_commands.py` lists the commands, their class and where shown.
"""

from __future__ import annotations

import ast
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, cli_env, free_port
from ddpkit import errors

DOCS = [REPO / "README.md", REPO / "README.zh-CN.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = {
    *("ddpkit", "python", "torchrun", "srun", "sbatch", "mpirun"),
    *("make", "pip", "docker", "kubectl", "tensorboard"),
}
ASSIGNMENTS = re.compile(r"^(?:[A-Z_]+=\S+\s+)*")
TIMEOUT = 300
# One epoch of the default recipe (scikit-learn's digits, the built-in CNN): the command's own data and model,
# only shorter. Appended to the `ddpkit train` lines run here; everything the line says still holds.
ONE_EPOCH = ["train.epochs=1"]
DIGITS_VAL = 359  # the validation split of the digits

# ------------------------------------------------------------------------------------- the classification
# Keys: a command line as the docs show it, comment dropped, continuation lines joined, runs of spaces as one.

# (a) run by a test of this file (the value: its name). Why the form run here keeps the line's meaning is said
# at the test.
RUN = {
    "ddpkit train": "test_train_one_process_and_two_workers",
    "ddpkit train --nproc-per-node 2": "test_train_one_process_and_two_workers",
    "ddpkit train --nproc-per-node 2 --launcher spawn": "test_train_two_spawned_workers",
    "torchrun --nproc-per-node 2 -m ddpkit train": "test_train_under_torchrun",
    "python -m torch.distributed.run --nproc-per-node 2 -m ddpkit train": "test_train_under_torchrun",
    "ddpkit eval checkpoint.path=runs/demo/checkpoints/best.pt --nproc-per-node 2": "test_eval_and_report",
    "ddpkit report runs/a runs/b --html report.html": "test_eval_and_report",
    "ddpkit report runs/a runs/b --out cmp.png --html cmp.html --json cmp.json --target 0.98": (
        "test_eval_and_report"
    ),
    "ddpkit train --init-method tcp://127.0.0.1:22225 --rank 0 --world-size 3": "test_train_by_hand_tcp",
    "ddpkit train --init-method tcp://127.0.0.1:22225 --rank 1 --world-size 3": "test_train_by_hand_tcp",
    "ddpkit train --init-method tcp://127.0.0.1:22225 --rank 2 --world-size 3": "test_train_by_hand_tcp",
    "ddpkit train --init-method file:///mnt/nfs/ddpkit-rdzv --rank R --world-size 2": "test_train_by_hand_file",
    "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 ddpkit train": (
        "test_train_from_torchrun_variables"
    ),
    "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 ddpkit train": (
        "test_train_from_torchrun_variables"
    ),
    "ddpkit k8s -c configs/cifar10_resnet18.yaml out_dir=runs/r18 --nodes 2 --gpus-per-node 4 --image "
    "registry.example.com/ddpkit:0.1 --name r18 --pvc ddpkit-runs --cpu 16 --memory 64Gi --data-pvc imagenet "
    "--backoff-limit 3 > r18.yaml": "test_k8s_manifest",
    "ddpkit run torchrun_ddp.py --epochs 3": "test_run_one_process",
    # the language-model lines (docs/language-model.md, parallelism.md, pipeline.md, run-dir.md): each line's own
    # config and layout, shortened (test_language_model_lines_train_as_written says how)
    "ddpkit train -c configs/text_gpt.yaml --nproc-per-node 2": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_llama.yaml dist.tp=2 model.activation_checkpointing=full --nproc-per-node 2": (
        "test_language_model_lines_train_as_written"
    ),
    "ddpkit train -c configs/text_llama.yaml model.arch=qwen3 --nproc-per-node 2": (
        "test_language_model_lines_train_as_written"
    ),
    "ddpkit train -c configs/text_llama.yaml model.arch=mistral model.sliding_window=32 --nproc-per-node 2": (
        "test_language_model_lines_train_as_written"
    ),
    "ddpkit train -c configs/text_gpt.yaml dist.strategy=ddp --nproc-per-node 2": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.strategy=zero1 --nproc-per-node 2": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.strategy=zero2 --nproc-per-node 2": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.strategy=fsdp dist.offload=cpu --nproc-per-node 2": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.strategy=hsdp dist.dp_shard=2 --nproc-per-node 4 --oversubscribe": (
        "test_language_model_lines_train_as_written"
    ),
    "ddpkit train -c configs/text_gpt.yaml dist.tp=2 --nproc-per-node 2": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.tp=2 --nproc-per-node 4 --oversubscribe": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml model.activation_checkpointing=full": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml model.activation_checkpointing=selective": (
        "test_language_model_lines_train_as_written"
    ),
    **{
        f"ddpkit train -c configs/text_gpt.yaml dist.pp=2 dist.pp_schedule={s} --nproc-per-node 2": (
            "test_language_model_lines_train_as_written"
        )
        for s in ("interleaved_zb", "zbv", "dualpipev")
    },
    "ddpkit train -c configs/text_gpt.yaml dist.pp=2 dist.pp_schedule=gpipe --nproc-per-node 2": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.pp=2 dist.pp_schedule=1f1b --nproc-per-node 2": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.pp=2 dist.pp_schedule=interleaved_1f1b --nproc-per-node 2": (
        "test_language_model_lines_train_as_written"
    ),
    "ddpkit train -c configs/text_gpt.yaml dist.pp=2 --nproc-per-node 4 --oversubscribe": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.pp=2 dist.tp=2 --nproc-per-node 4 --oversubscribe": "test_language_model_lines_train_as_written",
    "ddpkit train -c configs/text_gpt.yaml dist.tp=2 checkpoint.format=sharded --nproc-per-node 4 --oversubscribe": (
        "test_language_model_lines_train_as_written"
    ),
    "ddpkit train -c configs/text_gpt.yaml dist.strategy=fsdp checkpoint.format=sharded checkpoint.async_save=true "
    "--nproc-per-node 2": "test_language_model_lines_train_as_written",
    # the pod's command: the one the line above writes (`...`: the config's values); test_k8s.py runs it
    'python -m ddpkit train out_dir=runs/r18 ... data.root=/data --nproc-per-node 4 --nnodes 2 --node-rank "$RANK" '
    '--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"': "test_k8s_manifest",
}

# (b) run by another test (a pytest node id): the line, or the same line with tiny data/steps added.
LM_LOOP = "tests/commands/test_generate.py"
MOE_HF = "tests/models/test_experts_hf.py"
COVERED = {
    "ddpkit run --nproc-per-node 2 --straggler-timeout 10 stuck.py": (
        "tests/test_hostile_inputs.py::test_a_stuck_rank_is_named_with_its_stack_and_stacks_can_be_asked_for"
    ),
    "make demo": "tests/test_doc_commands.py::test_make_demo_trains_what_the_makefile_says",
    "ddpkit info --nproc-per-node 2": "tests/launcher/test_launch.py::test_info_nproc_per_node_uses_the_elastic_launcher",
    "ddpkit comm --nproc-per-node 2": "tests/diagnostics/test_comm.py::test_every_collective_checks_out_on_gloo_and_is_benchmarked",
    "ddpkit bench --nproc 1,2": "tests/commands/test_bench.py::test_bench_one_and_two_processes",
    # the same flags (--steps, --json, --out) on 1,2 processes: 4 CPU processes on 2 cores prove nothing more
    "ddpkit bench --nproc 1,2,4 --steps 20 --json bench.json --out bench.png": (
        "tests/commands/test_bench.py::test_bench_one_and_two_processes"
    ),
    # train.py is the user's torchrun-style script: the tests use the tutorial's, tests/scripts/torchrun_ddp.py
    "ddpkit run --nproc-per-node 2 train.py --epochs 3": (
        "tests/commands/test_run.py::test_torchrun_style_script_unchanged_gives_torchruns_weights"
    ),
    "ddpkit run --nproc-per-node 2 train.py --epochs 10": (
        "tests/commands/test_run.py::test_torchrun_style_script_unchanged_gives_torchruns_weights"
    ),
    "ddpkit run --nproc-per-node 2 torchrun_ddp.py --epochs 3": (
        "tests/commands/test_run.py::test_torchrun_style_script_unchanged_gives_torchruns_weights"
    ),
    "ddpkit run --nproc-per-node 2 --launcher spawn torchrun_ddp.py --epochs 3": (
        "tests/commands/test_run.py::test_torchrun_style_script_unchanged_gives_torchruns_weights"
    ),
    "srun -n 2 ddpkit run torchrun_ddp.py --epochs 3": (
        "tests/system/test_run_scripts.py::test_srun_two_tasks_run_a_torchrun_style_script_unchanged"
    ),
    "mpirun -np 2 ddpkit run torchrun_ddp.py --epochs 3": (
        "tests/system/test_run_scripts.py::test_mpirun_two_ranks_run_a_torchrun_style_script_unchanged"
    ),
    # two network namespaces stand for the two machines
    "ddpkit run --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 10.0.0.1 --master-port 29500 "
    "torchrun_ddp.py": "tests/system/test_run_scripts.py::test_two_hosts_run_a_torchrun_style_script_unchanged",
    "srun -n 2 python -m ddpkit train": "tests/system/test_slurm.py::test_srun_train_two_tasks_trains_one_job",
    "srun -N 2 --ntasks-per-node=2 python -m ddpkit train -c cfg.yaml": (
        "tests/system/test_slurm.py::test_srun_on_two_nodes_is_one_four_rank_job_like_four_processes_on_one_node"
    ),
    "srun -N 2 -n 4 python -m ddpkit info": (
        "tests/system/test_slurm.py::test_srun_on_two_nodes_is_one_four_rank_job_like_four_processes_on_one_node"
    ),
    "srun -N 2 -n 4 python -m ddpkit train -c cfg.yaml": (
        "tests/system/test_slurm.py::test_srun_on_two_nodes_is_one_four_rank_job_like_four_processes_on_one_node"
    ),
    "ddpkit slurm -c cfg.yaml --nodes 2 --ntasks-per-node 2 --gpus-per-node 0 --submit": (
        "tests/system/test_slurm.py::test_sbatch_on_two_nodes_with_a_space_and_a_hash_in_out_dir"
    ),
    "mpirun -np 2 ddpkit train": "tests/system/test_mpirun.py::test_mpirun_train_two_ranks_trains_one_job",
    "mpirun -np 2 python -m ddpkit train": "tests/system/test_mpirun.py::test_mpirun_train_two_ranks_trains_one_job",
    "GLOO_SOCKET_IFNAME=ib0 NCCL_SOCKET_IFNAME=ib0 ddpkit train --nnodes 2 ...": (
        "tests/system/test_multinode.py::test_the_users_interface_wins"
    ),
    "make test": "tests/test_doc_commands.py::test_make_test_runs_this_suite",
    # docs/porting.md's transformers Llama, each port of tests/scripts/hf_llama.py against the unported script
    **dict.fromkeys(
        (
            "ddpkit run --nproc-per-node 2 hf_llama.py --port fsdp",
            "ddpkit run --nproc-per-node 2 hf_llama.py --port tp",
            "ddpkit run --nproc-per-node 2 hf_llama.py --port pp",
            "ddpkit run --nproc-per-node 4 --oversubscribe hf_llama.py --port fsdp-tp",
        ),
        "tests/porting/test_hf_model.py::test_a_transformers_llama_trains_under_every_layout_as_its_unported_script",
    ),
    # docs/language-model.md: the lines with a tiny model and text added (one run shared by the tests there)
    "ddpkit eval -c configs/text_gpt.yaml checkpoint.path=runs/text_gpt/checkpoints/best.pt": (
        "tests/train/test_text_lm.py::test_eval_scores_the_checkpoint_as_training_did"
    ),
    "ddpkit report runs/text_gpt --out text_gpt.png": (
        "tests/train/test_text_lm.py::test_report_shows_a_language_models_loss_perplexity_and_tokens"
    ),
    # docs/language-model.md's loop: each line with a tiny model and text added (two runs shared by the tests)
    "ddpkit train -c configs/text_gpt.yaml data.tokenizer=bpe data.vocab_size=256 checkpoint.format=sharded "
    "out_dir=runs/bpe --nproc-per-node 2": f"{LM_LOOP}::test_a_bpe_run_saves_its_tokenizer_and_generate_repeats_greedy_text_from_sharded_checkpoints",
    'ddpkit generate runs/bpe --prompt "import os" --temperature 0': f"{LM_LOOP}::test_a_bpe_run_saves_its_tokenizer_and_generate_repeats_greedy_text_from_sharded_checkpoints",
    'ddpkit generate runs/bpe/checkpoints/last.dcp --prompt "import os" --temperature 1.5 --top-k 50 --seed 1': f"{LM_LOOP}::test_a_bpe_run_saves_its_tokenizer_and_generate_repeats_greedy_text_from_sharded_checkpoints",
    "ddpkit train -c configs/text_gpt.yaml data.dataset=tokens data.root=bins data.tokenizer_file=runs/bpe/tokenizer.json "
    "model.init_from=gpt2-tiny out_dir=runs/tokens": f"{LM_LOOP}::test_token_files_train_from_a_gpt2_folder_and_export_back_to_transformers",
    "ddpkit export runs/tokens --to hf runs/tokens-hf": f"{LM_LOOP}::test_token_files_train_from_a_gpt2_folder_and_export_back_to_transformers",
    "ddpkit train -c configs/text_llama.yaml data.dataset=tokens data.root=bins model.init_from=mixtral-tiny "
    "dist.ep=2 out_dir=runs/moe --nproc-per-node 2": f"{MOE_HF}::test_init_from_a_mixtral_folder_under_ep_trains_as_one_process_and_exports_back",
    "ddpkit export runs/moe --to hf runs/moe-hf": (
        f"{MOE_HF}::test_init_from_a_mixtral_folder_under_ep_trains_as_one_process_and_exports_back"
    ),
    "ddpkit info dist.tp=2 --nproc-per-node 2": "tests/launcher/test_launch.py::test_info_nproc_per_node_uses_the_elastic_launcher",
    # docs/parallelism.md's 3-D lines: the layout on 8 processes with the tiny transformer, compared with one process
    # (test_every_language_model_line_takes_the_language_model_recipe checks the line's recipe)
    "ddpkit train -c configs/text_gpt.yaml dist.tp=2 dist.pp=2 dist.strategy=fsdp train.max_steps=100 "
    "--nproc-per-node 8 --oversubscribe": (
        "tests/parallel/test_3d.py::"
        "test_fsdp_over_tp2_pp2_with_accumulation_writes_a_sharded_checkpoint_that_one_process_continues"
    ),
    "ddpkit train -c configs/text_llama.yaml dist.tp=2 dist.pp=2 dist.strategy=fsdp train.max_steps=100 "
    "--nproc-per-node 8 --oversubscribe": (
        "tests/models/test_llama.py::"
        "test_llama_under_sharded_data_parallel_x_tp2_x_pp2_on_8_processes_equals_one_process[fsdp]"
    ),
    # docs/parallelism.md's expert-parallel lines, the same layouts on the tiny mixture of experts
    **dict.fromkeys(
        (
            "ddpkit train -c configs/text_llama.yaml model.n_experts=4 model.experts_per_token=2 dist.ep=2 "
            "--nproc-per-node 2",
            *(
                f"ddpkit train -c configs/text_llama.yaml model.n_experts=4 dist.ep=2 {layout} --nproc-per-node 4 "
                "--oversubscribe"
                for layout in ("dist.strategy=fsdp", "dist.tp=2", "dist.pp=2")
            ),
        ),
        "tests/parallel/test_experts.py::"
        "test_every_layout_of_ep_equals_one_process_and_its_checkpoints_load_into_other_layouts",
    ),
    "ddpkit train -c configs/text_llama.yaml model.n_experts=4 dist.ep=2 dist.pp=2 dist.strategy=fsdp "
    "dist.pp_microbatches=2 train.max_steps=100 --nproc-per-node 8 --oversubscribe": (
        "tests/parallel/test_experts.py::test_ep2_x_pp2_x_fsdp_on_8_processes_equals_one_process"
    ),
}

# (c) needs what this machine (2 CPU cores, no GPU, one host, no cluster services, no internet) lacks.
NEEDS = {
    "srun -n 4 ddpkit train -c configs/cifar10_resnet18.yaml": "a Slurm cluster and CIFAR-10 (a download)",
    "ddpkit train --init-method tcp://10.0.0.1:22225 --rank 0 --world-size 3": (
        "three machines, one at 10.0.0.1 (the same by hand on 127.0.0.1: test_train_by_hand_tcp)"
    ),
    "ddpkit train -c configs/cifar10_resnet18.yaml train.batch_size=128 optim.lr=0.02 out_dir=runs/r18": (
        "CIFAR-10 (a download) and a GPU for a ResNet-18 run"
    ),
    "ddpkit train -c configs/cifar10_resnet18.yaml --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr "
    "10.0.0.1 --master-port 29500": "two machines and CIFAR-10 (two namespaces: test_multinode.py)",
    "ddpkit train -c configs/cifar10_resnet18.yaml --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr "
    "10.0.0.1 --master-port 29500": "two machines and CIFAR-10 (two namespaces: test_multinode.py)",
    "ddpkit train --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 10.0.0.1:29400 --rdzv-id digits-42 --rdzv-timeout 300": (
        "two machines, one at 10.0.0.1 (c10d on two namespaces: test_multinode.py)"
    ),
    "srun --ntasks-per-node=8 -n32 --gres=gpu:8 python -m ddpkit train": "4 Slurm nodes of 8 GPUs",
    "ddpkit slurm -c configs/cifar10_resnet18.yaml out_dir=runs/r18 --nodes 2 --gpus-per-node 4 --cpus-per-task 8 "
    "--partition gpu --time 12:00:00 --submit": "a Slurm cluster with a `gpu` partition of 4-GPU nodes",
    "mpirun -np 4 -H node0:2,node1:2 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 -x PATH -x OMP_NUM_THREADS python "
    "-m ddpkit train": "two machines named node0 and node1 reachable by Open MPI's ssh",
    "kubectl apply -f r18.yaml": "a Kubernetes cluster with Kubeflow's Training Operator",
    "ddpkit info --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500": (
        "two machines, one at 10.0.0.1 (two namespaces: test_multinode.py)"
    ),
    "srun -N 2 --ntasks-per-node 1 ddpkit run --nnodes 2 --nproc-per-node 4 torchrun_ddp.py": (
        "a Slurm cluster of two nodes with 4 GPUs each"
    ),
    "ddpkit train -c configs/cifar10_resnet18.yaml --nproc-per-node 8 --max-restarts 3 "
    "checkpoint.every_steps=500": "8 GPUs and CIFAR-10 (restarts on CPU: test_reliability.py)",
}

# Placeholders of the docs, for parsing a line here: the user's own files and values, a launcher's variables.
PLACEHOLDERS = {
    "cfg.yaml": "configs/digits.yaml",
    "train.py": "tests/scripts/torchrun_ddp.py",
    "torchrun_ddp.py": "tests/scripts/torchrun_ddp.py",  # porting.md: its lines run in tests/scripts/
    "hf_llama.py": "tests/scripts/hf_llama.py",  # porting.md: its lines run in tests/scripts/ too
    "stuck.py": "tests/scripts/stuck_rank.py",  # reliability.md: the straggler test runs it as stuck.py
    "R": "0",
    "$RANK": "1",
    "$MASTER_ADDR": "10.0.0.1",
    "$MASTER_PORT": "29500",
}


def _normalised(text: str) -> str:
    return " ".join(re.sub(r"\s#(\s.*)?$", "", text).split())


def doc_commands() -> dict[str, list[str]]:
    """{normalised command line: [where it is shown, as FILE:LINE]} over every fenced block of the docs."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        fenced, pending, start = False, "", 0
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            text = line.strip()
            if text.startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            if not pending:
                words = ASSIGNMENTS.sub("", text).split()
                if not words or words[0] not in PROGRAMS:
                    continue
                start = number
            code = _normalised(text)
            if code.endswith("\\"):
                pending += code[:-1] + " "
                continue
            found.setdefault(_normalised(pending + code), []).append(f"{doc.relative_to(REPO)}:{start}")
            pending = ""
    return found


def commands_run_by(test: str) -> list[str]:
    chosen = [c for c, t in RUN.items() if t == test]
    assert chosen, f"no doc command is run by {test}"
    return chosen


def split_line(command: str, replace: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """(VAR=value assignments, the words of the program and its arguments), each `old` word replaced."""
    words = [(replace or {}).get(w, w) for w in shlex.split(command)]
    env = {}
    while re.fullmatch(r"[A-Z_]+=\S+", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def argv_here(words: list[str]) -> list[str]:
    """The program of a doc line as this machine runs it: this interpreter, its torchrun, its ddpkit."""
    program = {
        "ddpkit": [sys.executable, "-m", "ddpkit"],
        "python": [sys.executable],
        "torchrun": [str(Path(sys.executable).parent / "torchrun")],
    }[words[0]]
    return program + words[1:]


def start(command: str, *extra: str, cwd: Path, replace=None, env=None) -> subprocess.Popen:
    """Start one doc line (+ `extra` arguments) in `cwd`, as if typed in its own terminal."""
    assigned, words = split_line(command, replace)
    return subprocess.Popen(
        argv_here(words) + list(extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env({**assigned, **(env or {})}),
        cwd=cwd,
    )


def finish(*procs: subprocess.Popen) -> list[str]:
    """Every process's stdout; each must exit 0."""
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, (p.args, p.returncode, stdout[-2000:], stderr[-3000:])
            outs.append(stdout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def assert_trained(out_dir: Path, world_size: int) -> None:
    """One epoch of the digits recipe on `world_size` processes, every validation sample scored once."""
    rows = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [(r["epoch"], r["world_size"], r["val_samples"]) for r in rows] == [(1, world_size, DIGITS_VAL)]


# ------------------------------------------------------------------------------------ the classification


def test_the_docs_show_the_commands_this_test_reads():
    found = doc_commands()
    assert len(found) >= 50, sorted(found)
    shown = [where.split(":")[0] for where in found["ddpkit train --nproc-per-node 2"]]
    assert shown == ["README.md", "README.md", "docs/launching.md"]
    # the two lines of launching.md's `ddpkit slurm ... \` joined into one, its comment gone
    continued = [c for c in found if c.startswith("ddpkit slurm -c configs/cifar10_resnet18.yaml")]
    assert continued == [c for c in NEEDS if c.startswith("ddpkit slurm")]
    assert not [c for c in found if "#" in c or "\\" in c]


def test_every_doc_command_is_classified_once_and_every_mapping_is_in_the_docs():
    found = doc_commands()
    classes = {"RUN": RUN, "COVERED": COVERED, "NEEDS": NEEDS}
    unclassified = {c: where for c, where in found.items() if not any(c in m for m in classes.values())}
    assert not unclassified, (
        "doc commands in none of RUN, COVERED, NEEDS (run them here, name the test that runs them, or say "
        f"what they need): {unclassified}"
    )
    twice = [c for c in found if sum(c in m for m in classes.values()) > 1]
    assert not twice, twice
    stale = {name: [c for c in m if c not in found] for name, m in classes.items()}
    assert stale == {name: [] for name in classes}, "mapped commands no longer in the docs"


def test_every_test_run_covers_exists():
    here = {n.name for n in ast.parse(Path(__file__).read_text()).body if isinstance(n, ast.FunctionDef)}
    assert set(RUN.values()) <= here, set(RUN.values()) - here
    for command, node in COVERED.items():
        path, _, name = node.partition("::")
        functions = {
            n.name for n in ast.walk(ast.parse((REPO / path).read_text())) if isinstance(n, ast.FunctionDef)
        }
        assert name.split("[")[0] in functions and name.startswith("test_"), (command, node)


def _ddpkit_words(command: str) -> tuple[list[str], bool] | None:
    """(the words after `ddpkit`, whether its launch is partly elsewhere: a launcher (srun, mpirun) starts it,
    or the line elides flags with `...`), placeholders filled in."""
    _, words = split_line(command, PLACEHOLDERS)
    if "ddpkit" not in words:
        return None
    at = words.index("ddpkit")
    after = [w for w in words[at + 1 :] if w != "..."]
    if ">" in after:  # a redirection of the shell
        after = after[: after.index(">")]
    return after, words[0] in ("srun", "mpirun") or "..." in words


DDPKIT_LINES = sorted(c for c in doc_commands() if _ddpkit_words(c))


def assert_parses(shown: str, words: list[str], launched_elsewhere: bool) -> None:
    """`ddpkit WORDS` parses as the CLI parses it: flags, config keys and values, launch flags, the script."""
    from ddpkit.cli import _load, command_parser, parse
    from ddpkit.commands import COMMANDS
    from ddpkit.commands.run import _parser, split
    from ddpkit.launcher.spec import spec_from_args

    try:
        if COMMANDS[words[0]].mode == "script" and words[0] != "run":  # generate, export: their own flags
            flags = words[1:]
            parser = COMMANDS[words[0]].module.parser()
            args = parser.parse_args(flags)
        elif COMMANDS[words[0]].mode == "script":
            flags, target = split(words[1:])
            parser = _parser()
            args = parser.parse_args(flags)
            assert Path(target[0]).is_file(), target
        else:
            flags = words[1:]
            parser = command_parser(COMMANDS[words[0]])
            command, args = parse(words)
            _load(command, args)
        if hasattr(args, "nproc_per_node") and not launched_elsewhere:
            spec_from_args(args, environ={})
    except errors.UserError as e:
        pytest.fail(f"{shown!r}: ddpkit refuses it: {e}")
    # argparse takes a unique prefix of a flag too (`--nproc` for `--nproc-per-node`): the docs spell them out
    abbreviated = [
        f for f in flags if f.startswith("-") and f.split("=")[0] not in parser._option_string_actions
    ]
    assert not abbreviated, f"{shown!r}: write these flags in full: {abbreviated}"


@pytest.mark.parametrize("command", DDPKIT_LINES)
def test_every_ddpkit_line_parses_as_the_cli_parses_it(command, monkeypatch):
    monkeypatch.chdir(REPO)  # the docs' paths (configs/...) are the repository's
    assert_parses(command, *_ddpkit_words(command))


# The prose's own `ddpkit CMD --flag ...` spans, with their capitalised placeholders filled in; a span of usage
# syntax (`[launch flags]`, `CMD`) or a pipe is no command line.
INLINE = re.compile(r"`((?:python -m )?ddpkit \w+ [^`]*[-=][^`]*)`")
INLINE_VALUES = {"N": "2", "R": "0", "W": "2", "HOST": "10.0.0.1", "PORT": "29500", "JOB": "job-7"}
INLINE_VALUES |= {"config.yaml": "configs/digits.yaml", "spawn_ddp.py": "tests/scripts/spawn_ddp.py"}
INLINE_VALUES |= {"train.py": "tests/scripts/torchrun_ddp.py"}  # porting.md: the user's torchrun-style script
# data.dataset=signs is the data set that docs/extending.md's own package registers: test_extending.py runs it.
INLINE_ELSEWHERE = {"ddpkit train data.dataset=signs model.arch=mlp --nproc-per-node 2"}


def inline_commands() -> list[str]:
    spans = {m[1] for doc in DOCS for m in INLINE.finditer(doc.read_text())}
    return sorted(s for s in spans if not re.search(r"\[|\||\bCMD\b", s) and s not in INLINE_ELSEWHERE)


def test_the_prose_shows_the_inline_commands_this_test_reads():
    spans = inline_commands()
    assert "ddpkit train --init-method tcp://HOST:PORT --rank R --world-size W" in spans, spans
    found = {m[1] for doc in DOCS for m in INLINE.finditer(doc.read_text())}
    assert INLINE_ELSEWHERE <= found, "INLINE_ELSEWHERE names a span no longer in the docs"


@pytest.mark.parametrize("span", inline_commands())
def test_every_inline_ddpkit_command_parses(span, monkeypatch):
    monkeypatch.chdir(REPO)
    filled = re.sub(r"\b[A-Z]+\b|\b[\w.]+\.(?:yaml|py)\b", lambda m: INLINE_VALUES.get(m[0], m[0]), span)
    words = [w for w in shlex.split(filled) if w != "..." and not w.endswith("=...")]
    assert_parses(span, words[words.index("ddpkit") + 1 :], launched_elsewhere="..." in span)


MAKE_LINES = sorted(c for c in doc_commands() if c.startswith("make "))


@pytest.mark.parametrize("command", MAKE_LINES)
def test_every_make_line_is_a_target_of_the_makefile(command):
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", *command.split()[1:]], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    # the dry run prints the target's own recipe: each of its words that names no make variable
    makefile = (REPO / "Makefile").read_text()
    for target in command.split()[1:]:
        recipe = makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
        words = {w for line in recipe for w in line.split() if "$" not in w}
        assert recipe and words <= set(proc.stdout.split()), (target, words - set(proc.stdout.split()))


@pytest.mark.slow
def test_make_demo_trains_what_the_makefile_says(tmp_path):
    # `make demo` first creates .venv and pip-installs the project (PyPI, minutes); the line it then runs is
    # read from the Makefile and run here with this interpreter's ddpkit, for one epoch, in an empty folder.
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "demo"], cwd=REPO, capture_output=True, text=True, check=True
    )
    (train,) = [ln for ln in proc.stdout.splitlines() if " train " in ln]
    assert train == ".venv/bin/ddpkit train -c configs/digits.yaml out_dir=runs/demo --nproc-per-node 2", (
        train
    )
    config = {"configs/digits.yaml": str(REPO / "configs" / "digits.yaml")}
    finish(start(train.removeprefix(".venv/bin/"), *ONE_EPOCH, cwd=tmp_path, replace=config))
    assert_trained(tmp_path / "runs" / "demo", 2)


def test_make_test_runs_this_suite():
    # `make test` is the whole suite (20+ minutes, this file included): it runs in CI, never from a test.
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True
    )
    words = proc.stdout.splitlines()[-1].split()
    assert words[:4] == [".venv/bin/python", "-m", "pytest", "tests"]  # the whole suite: no -m, -k or path
    assert not {"-m", "-k", "-x"} & set(words[4:]) and not [w for w in words[4:] if w.startswith("tests")]
    # on parallel workers, the serial group together, ending with the 20 slowest tests
    assert "-n 2 --dist loadgroup" in " ".join(words) and "--durations=20" in words


# ---------------------------------------------------------------------------------- (a) the lines run here


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A folder where the docs' `ddpkit train` and `ddpkit train --nproc-per-node 2` ran at once for one epoch,
    into runs/a and runs/b (the runs the report lines compare)."""
    folder = tmp_path_factory.mktemp("docs")
    one, two = commands_run_by("test_train_one_process_and_two_workers")
    finish(
        start(one, *ONE_EPOCH, "out_dir=runs/a", cwd=folder),
        start(two, *ONE_EPOCH, "out_dir=runs/b", cwd=folder),
    )
    return folder


@pytest.mark.slow
def test_train_one_process_and_two_workers(runs):
    assert_trained(runs / "runs" / "a", 1)
    assert_trained(runs / "runs" / "b", 2)


@pytest.mark.slow
def test_train_two_spawned_workers(tmp_path):
    (command,) = commands_run_by("test_train_two_spawned_workers")
    finish(start(command, *ONE_EPOCH, cwd=tmp_path))
    assert_trained(tmp_path / "runs" / "default", 2)


@pytest.mark.slow
def test_train_under_torchrun(tmp_path):
    # torchrun's default port 29500 may be held by another run on a shared machine: a free one each, told to
    # it the way torchrun takes it (before `-m ddpkit`). The two lines run at once, each in its own folder.
    procs = []
    for i, command in enumerate(commands_run_by("test_train_under_torchrun")):
        env, words = split_line(command)
        at = words.index("ddpkit") - 1
        line = shlex.join([*words[:at], "--master-port", str(free_port()), *words[at:]])
        (tmp_path / str(i)).mkdir()
        procs.append(start(line, *ONE_EPOCH, cwd=tmp_path / str(i), env=env))
    finish(*procs)
    for i in range(len(procs)):
        assert_trained(tmp_path / str(i) / "runs" / "default", 2)


@pytest.mark.slow
def test_eval_and_report(runs):
    # runs/demo (as `make demo` writes it) is a copy of runs/a; then the lines themselves, unchanged.
    shutil.copytree(runs / "runs" / "a", runs / "runs" / "demo")
    evaluate, *reports = commands_run_by("test_eval_and_report")
    # independent lines (the reports read runs/a and runs/b and write files of their own): all at once
    outs = finish(*[start(line, cwd=runs) for line in (evaluate, *reports)])
    scores = json.loads(outs[0].splitlines()[-1])
    trained = json.loads((runs / "runs" / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"val_loss", "val_acc1", "val_acc5", "val_samples"} <= set(scores)  # as cli.md says
    assert (scores["world_size"], scores["val_samples"]) == (2, DIGITS_VAL)  # every sample once
    assert scores["val_acc1"] == pytest.approx(trained["val_acc1"], abs=1e-9)  # the checkpoint's own score
    assert "<table" in (runs / "report.html").read_text()
    table = json.loads((runs / "cmp.json").read_text())
    assert len(table["runs"]) == 2, table
    assert (runs / "cmp.png").stat().st_size > 0 and "<table" in (runs / "cmp.html").read_text()


@pytest.mark.slow
def test_train_by_hand_tcp(tmp_path):
    # Three terminals on one machine, as the doc's 127.0.0.1 says; its port 22225 may be taken on a shared
    # machine, so a free one in its place.
    port = str(free_port())
    lines = commands_run_by("test_train_by_hand_tcp")
    url = {"tcp://127.0.0.1:22225": f"tcp://127.0.0.1:{port}"}
    finish(*[start(line, *ONE_EPOCH, cwd=tmp_path, replace=url) for line in lines])
    assert_trained(tmp_path / "runs" / "default", 3)


@pytest.mark.slow
def test_train_by_hand_file(tmp_path):
    # The shared file system's file is a file of this machine; R is each rank in turn.
    (line,) = commands_run_by("test_train_by_hand_file")
    url = {"file:///mnt/nfs/ddpkit-rdzv": f"file://{tmp_path}/ddpkit-rdzv"}
    finish(*[start(line, *ONE_EPOCH, cwd=tmp_path, replace={**url, "R": str(r)}) for r in range(2)])
    assert_trained(tmp_path / "runs" / "default", 2)


@pytest.mark.slow
def test_train_from_torchrun_variables(tmp_path):
    # Machine 1 and machine 2 are two processes here: the master's address is this machine's, its port a free
    # one (29500 may be taken on a shared machine).
    here = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    lines = commands_run_by("test_train_from_torchrun_variables")
    finish(*[start(line, *ONE_EPOCH, cwd=tmp_path, env=here) for line in lines])
    assert_trained(tmp_path / "runs" / "default", 2)


def test_k8s_manifest(tmp_path):
    line, pod_line = sorted(
        commands_run_by("test_k8s_manifest"), key=lambda c: not c.startswith("ddpkit k8s")
    )
    _, words = split_line(line)
    at = words.index(">")
    (out,) = finish(start(shlex.join(words[:at]), cwd=REPO))
    (tmp_path / words[at + 1]).write_text(out)  # what the shell's `> r18.yaml` does
    job = yaml.safe_load((tmp_path / "r18.yaml").read_text())
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == (
        "kubeflow.org/v1",
        "PyTorchJob",
        "r18",
    )
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 1)
    container = specs["Master"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/ddpkit:0.1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    (shown,) = [ln.strip() for ln in container["command"][-1].splitlines() if ln.strip().startswith("python")]
    before, after = pod_line.split(" ... ")
    assert shown.startswith(before + " ") and shown.endswith(" " + after + " &"), (shown, pod_line)


@pytest.mark.slow
def test_run_one_process(tmp_path):
    # The script the line names (tests/scripts/torchrun_ddp.py), copied into an empty folder: it writes its
    # snapshot into the current one.
    (line,) = commands_run_by("test_run_one_process")
    (tmp_path / "torchrun_ddp.py").write_text((REPO / "tests" / "scripts" / "torchrun_ddp.py").read_text())
    out = finish(start(line, cwd=tmp_path))[0]
    assert (tmp_path / "snapshot.pt").is_file(), out


# The language-model lines. Every one (whatever its class) starts from configs/text_gpt.yaml or text_llama.yaml,
# the language-model recipe (AdamW at its own lr, a warmup, a cosine decay over a step budget of at most 200
# optimizer steps), changes none of the recipe's keys but to shorten the budget, and carries --oversubscribe
# where it starts more processes than a 2-core machine has. Those run here: the Trainer that `ddpkit train` runs,
# on the test worker's pooled ranks of the line's world size (no launch: test_every_ddpkit_line_parses_as_the_cli_
# parses_it checks the launch flags), the line's config and layout for 1 optimizer step on the first 20 kB of
# its text (as written: 200 steps on 1 MB, under 5 minutes on 2 cores, docs/language-model.md). The 8-process
# lines are the 3-D tests' (COVERED).
LM_CONFIGS = ("configs/text_gpt.yaml", "configs/text_llama.yaml")
RECIPE = ("optim.", "train.epochs", "train.batch_size", "train.grad_accum_steps", "train.clip_grad_norm")
SHORT = ["train.max_steps=1", "data.text_bytes=20000", "report.curves=false"]


def _language_model_lines() -> list[str]:
    from ddpkit.models import language_models

    named = re.compile(r"model\.arch=(\S+)|data\.dataset=(text|tokens)\b|configs/text_")
    lms = set(language_models())
    return [
        c
        for c in doc_commands()
        if c.startswith("ddpkit train")
        and any(m[0].startswith(("data.", "configs/")) or m[1] in lms for m in named.finditer(c))
    ]


def test_every_language_model_line_takes_the_language_model_recipe():
    from ddpkit.cli import parse
    from ddpkit.config import load_config

    for config in LM_CONFIGS:
        cfg = load_config(str(REPO / config), [])
        assert (cfg.optim.name, cfg.optim.ref_batch_size, cfg.optim.schedule) == ("adamw", None, "cosine")
        assert cfg.optim.warmup_epochs > 0 and cfg.train.max_steps == 200 and cfg.data.dataset == "text"
    lines = _language_model_lines()
    assert len(lines) >= 20, lines
    for command in lines:
        _, args = parse(split_line(command)[1][1:])
        assert args.config in LM_CONFIGS, command
        assert not [o for o in args.overrides if o.startswith(RECIPE)], command
        steps = [int(o.split("=")[1]) for o in args.overrides if o.startswith("train.max_steps=")]
        assert all(s <= 200 for s in steps), command
        assert (int(args.nproc_per_node or 1) > 2) == ("--oversubscribe" in command), command


def _train_lines(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> None:
    from conftest import dist_context
    from ddpkit.config import load_config
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    for config, overrides in runs:
        with Heartbeat(rank, world_size) as heartbeat:
            Trainer(load_config(config, overrides), dist_context(rank, world_size), heartbeat).fit()


@pytest.mark.slow
def test_language_model_lines_train_as_written(tmp_path):
    from conftest import run_group
    from ddpkit.cli import parse

    lines = commands_run_by("test_language_model_lines_train_as_written")
    by_size: dict[int, list[tuple[str, list[str]]]] = {}
    sizes = []
    for i, command in enumerate(lines):
        _, args = parse(split_line(command)[1][1:])
        sizes.append(int(args.nproc_per_node or 1))
        run = [*args.overrides, *SHORT, f"out_dir={tmp_path / str(i)}"]
        by_size.setdefault(sizes[-1], []).append((str(REPO / args.config), run))
    assert sorted(by_size) == [1, 2, 4]
    _train_lines(0, 1, by_size.pop(1))  # one process: in this one
    for nproc, runs in sorted(by_size.items()):
        run_group(_train_lines, nproc, runs, timeout=600)
    for i, command in enumerate(lines):
        rows = [json.loads(ln) for ln in (tmp_path / str(i) / "metrics.jsonl").read_text().splitlines()]
        assert (rows[-1]["step"], rows[-1]["world_size"]) == (1, sizes[i]), command
        assert math.isfinite(rows[-1]["train_loss"]) and math.isfinite(rows[-1]["val_loss"]), command


if __name__ == "__main__":
    for line, where in doc_commands().items():
        kind = next(
            (k for k, m in (("RUN", RUN), ("COVERED", COVERED), ("NEEDS", NEEDS)) if line in m), "NONE"
        )
        print(f"{kind:8s} {line}    [{', '.join(where)}]")
