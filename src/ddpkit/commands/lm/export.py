"""`ddpkit export CHECKPOINT --to hf OUT_DIR`: a trained language model (a .pt or .dcp checkpoint, or a run
directory: its best checkpoint, else its last) written as a Hugging Face folder of its family's architecture
(config.json, model.safetensors or shards of at most --max-shard-size with their index, and, when the run has one,
tokenizer.json) that transformers' AutoModelForCausalLM loads. A sharded checkpoint is read tensor by tensor and
written file by file: it is never gathered whole."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddpkit.commands import CommandParser
from ddpkit.errors import UserError


def parser():
    """The command's own flags (the docs' lines are parsed with it too)."""
    p = CommandParser(prog="ddpkit export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a .pt / .dcp checkpoint or a run's out_dir")
    p.add_argument("--to", required=True, choices=["hf"], help="the format to write: hf (Hugging Face)")
    p.add_argument("out", metavar="OUT_DIR", help="the folder to write (new, or empty)")
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="the largest safetensors file, e.g. 500MB or 2GiB (default 5GB, transformers 4's); a larger model is "
        "split into shards with an index",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="the weights' type in the folder (default fp32, the checkpoint's)",
    )
    return p


def export_command(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    from ddpkit.checkpoint import save_text
    from ddpkit.models.loading import export_checkpoint

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"OUT_DIR '{out}' exists and is not an empty folder", "give a new folder")
    loaded = export_checkpoint(args.checkpoint, out, args.dtype, args.max_shard_size)
    if loaded.tokenizer:
        save_text(out / "tokenizer.json", loaded.tokenizer)
    print(f"wrote {out} (a {type(loaded.model).__name__}, from {loaded.source})", flush=True)
    return 0
