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

from ddpkit.commands import CommandParser
from ddpkit.data.text.tokenizer import encode_prompt, from_json
from ddpkit.errors import UserError, first_line
from ddpkit.models.loading import from_checkpoint

# The stated ranges of the flags (docs/cli.md): a temperature below MIN_TEMPERATURE overflows the logits it
# divides; a seed is what torch.Generator takes; --max-new-tokens at most CONTEXTS contexts of the model.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
MAX_SEED = 2**63 - 1
CONTEXTS = 16


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise argparse.ArgumentTypeError(
            f"must be 0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}, not {first_line(text, 40)}"
        )
    return value


def _integer(low: int, high: int | None = None):
    """An argparse type: an integer from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, not {first_line(text, 40)}")
        return value

    return parse


def check_bounds(args: argparse.Namespace, block_size: int, vocab: int) -> None:
    """UserError when --max-new-tokens or --top-k exceed what the model allows."""
    most = CONTEXTS * block_size
    if args.max_new_tokens > most:
        raise UserError(
            f"--max-new-tokens {args.max_new_tokens} is over {CONTEXTS} times this model's context of "
            f"{block_size} tokens ({most})",
            f"give at most {most}; run generate on its output for more",
        )
    if args.top_k is not None and args.top_k > vocab:
        raise UserError(
            f"--top-k {args.top_k} is over this model's vocabulary of {vocab} tokens",
            f"give at most {vocab}, or leave --top-k out to sample from every token",
        )


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
    p = CommandParser(prog="ddpkit generate", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT", help="a run's out_dir, or a .pt / .dcp checkpoint")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=_integer(1),
        default=100,
        help=f"tokens to add, at most {CONTEXTS} times the model's context (default 100)",
    )
    p.add_argument(
        "--temperature",
        type=_temperature,
        default=1.0,
        help=f"0: greedy, else from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g} (default 1.0)",
    )
    p.add_argument(
        "--top-k",
        type=_integer(1),
        default=None,
        help="sample among the K likeliest tokens only (at most the vocabulary's size)",
    )
    p.add_argument(
        "--seed", type=_integer(0, MAX_SEED), default=0, help="the sampling generator's seed (default 0)"
    )
    return p


def generate_command(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))

    if not args.prompt:
        raise UserError("--prompt is empty", "give the text to continue, e.g. --prompt 'def main'")
    loaded = from_checkpoint(args.run)
    if loaded.tokenizer is None:
        raise UserError(
            f"the run of '{loaded.source}' has no tokenizer.json",
            "train with data.tokenizer_file=tokenizer.json or nanoGPT's meta.pkl beside train.bin, or data.dataset=text",
        )
    tok = from_json(loaded.tokenizer, f"the tokenizer of '{loaded.source}'")
    check_bounds(args, loaded.model.block_size, loaded.model.vocab_size)
    ids = encode_prompt(tok, args.prompt)
    out = sample(loaded.model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + tok.decode(out[len(ids) :]), flush=True)
    return 0
