"""`ddpkit export CHECKPOINT --to hf OUT_DIR`: a trained GPT or Llama (a .pt or .dcp checkpoint, or a run
directory: its best checkpoint, else its last) written as a Hugging Face GPT-2 or Llama folder (config.json,
model.safetensors and, when the run has one, tokenizer.json) that transformers' AutoModelForCausalLM loads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddpkit.commands import CommandParser
from ddpkit.errors import UserError
from ddpkit.models import family_of_module


def parser():
    """The command's own flags (the docs' lines are parsed with it too)."""
    p = CommandParser(prog="ddpkit export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a .pt / .dcp checkpoint or a run's out_dir")
    p.add_argument("--to", required=True, choices=["hf"], help="the format to write: hf (Hugging Face)")
    p.add_argument("out", metavar="OUT_DIR", help="the folder to write (new, or empty)")
    return p


def export_command(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    from ddpkit.checkpoint import save_text
    from ddpkit.models.hf import export
    from ddpkit.models.loading import from_checkpoint

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"OUT_DIR '{out}' exists and is not an empty folder", "give a new folder")
    loaded = from_checkpoint(args.checkpoint)
    export(loaded.model, out, family_of_module(loaded.model))
    if loaded.tokenizer:
        save_text(out / "tokenizer.json", loaded.tokenizer)
    print(f"wrote {out} (a {type(loaded.model).__name__}, from {loaded.source})", flush=True)
    return 0
