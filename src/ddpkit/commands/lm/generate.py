"""`ddpkit generate RUN_DIR_OR_CHECKPOINT --prompt TEXT`: text from a trained language model, on this one process
whatever layout trained it (a full .pt or a sharded .dcp checkpoint; a run directory: its best checkpoint, else its
last), with the run's tokenizer. Prints the prompt and its continuation. --temperature 0 is greedy (the same text
every time); above 0 the next token is drawn from softmax(logits / T), from the --top-k likeliest when given, with
the generator seeded by --seed.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch

from ddpkit.errors import UserError


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be an integer > 0, not {text}")
    return value


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[int]:
    """`ids` and `max_new_tokens` more, each from the last data.block_size tokens of context."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor([ids], dtype=torch.long)
    block = getattr(model, "block_size", None) or x.shape[1] + max_new_tokens
    for _ in range(max_new_tokens):
        logits = model(x[:, -block:])[0, -1].float()
        if temperature == 0:
            nxt = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                cut = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cut, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        x = torch.cat([x, nxt.view(1, 1)], dim=1)
    return x[0].tolist()


def parser():
    """The command's own flags (the docs' lines are parsed with it too)."""
    from ddpkit.commands import CommandParser

    p = CommandParser(prog="ddpkit generate", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT", help="a run's out_dir, or a .pt / .dcp checkpoint")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=_positive, default=100, help="tokens to add (default 100)")
    p.add_argument("--temperature", type=_nonneg_float, default=1.0, help="0: greedy (default 1.0)")
    p.add_argument("--top-k", type=_positive, default=None, help="sample among the K likeliest tokens only")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default 0)")
    return p


def generate_command(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    from ddpkit.data.text.tokenizer import encode_prompt, from_json
    from ddpkit.models.loading import from_checkpoint

    if not args.prompt:
        raise UserError("--prompt is empty", "give the text to continue, e.g. --prompt 'def main'")
    loaded = from_checkpoint(args.run)
    if loaded.tokenizer is None:
        raise UserError(
            f"the run of '{loaded.source}' has no tokenizer.json",
            "train with data.dataset=text, or give data.dataset=tokens its data.tokenizer_file",
        )
    tok = from_json(loaded.tokenizer, f"the tokenizer of '{loaded.source}'")
    ids = encode_prompt(tok, args.prompt)
    out = sample(loaded.model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + tok.decode(out[len(ids) :]), flush=True)
    return 0
