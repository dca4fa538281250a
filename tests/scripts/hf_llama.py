# A small Llama trained with Hugging Face transformers, the way its user writes the script before hearing of
# ddpkit: a data set of their own, a shuffled DataLoader with a seeded generator, AdamW, a loop printing the loss.
# `--port` picks a port of docs/porting.md ("none": the script as its user wrote it); tests/porting/test_hf_model.py
# runs each under `ddpkit run` and compares every step's loss with the unported script's.
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--port", default="none", choices=["none", "fsdp", "tp", "pp", "fsdp-tp", "pp-wrapper"])
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()


class Windows(Dataset):
    """Windows of a learnable token stream: (x, y) = (tokens[i:i+T], tokens[i+1:i+1+T])."""

    def __init__(self, n_tokens, block_size, vocab_size):
        g = torch.Generator().manual_seed(1337)
        self.tokens = (
            torch.arange(n_tokens) * 7 + torch.randint(0, 3, (n_tokens,), generator=g)
        ) % vocab_size
        self.block_size = block_size

    def __len__(self):
        return len(self.tokens) - self.block_size

    def __getitem__(self, i):
        chunk = self.tokens[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
loader = DataLoader(
    Windows(600, 16, config.vocab_size),
    batch_size=8,
    shuffle=True,
    drop_last=True,
    generator=torch.Generator().manual_seed(1234),
)

main_process, pipeline = True, args.port.startswith("pp")
if args.port != "none":
    import ddpkit

    layouts = {"fsdp": {"strategy": "fsdp"}, "tp": {"tp": 2}, "fsdp-tp": {"strategy": "fsdp", "tp": 2}}
    if (
        args.port == "pp-wrapper"
    ):  # a layer loop written by hand: what the model's pipeline plan makes needless

        class Logits(nn.Module):
            def __init__(self, llama):
                super().__init__()
                self.llama = llama

            def forward(self, idx):
                body = self.llama.model
                h = body.embed_tokens(idx)
                positions = body.rotary_emb(h, torch.arange(idx.size(1)).unsqueeze(0))
                for layer in body.layers:
                    h = layer(h, position_embeddings=positions)
                return self.llama.lm_head(body.norm(h))

        model = Logits(model)
        layouts["pp-wrapper"] = {"pp": 2, "pp_split": ["llama.model.layers.2"]}
    layout = layouts.get(args.port, {"pp": 2})
    if pipeline:
        layout["loss_fn"] = loss_fn
    model, optimizer, loader = ddpkit.prepare(model, optimizer, loader, split_batches=True, **layout)
    main_process = ddpkit.is_main_process()

model.train()
for step, (x, y) in enumerate(loader):
    if step == args.steps:
        break
    if pipeline:
        loss = model.step(x, y)
    else:
        loss = loss_fn(model(input_ids=x).logits, y)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if args.port != "none":
        loss = ddpkit.all_reduce_mean(loss.detach())  # the global batch's loss, as the unported script's
    if main_process:
        print(f"step {step}: loss {loss.item():.6f}")
