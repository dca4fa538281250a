"""
A tiny GPT language model and its training loop, written the way nanoGPT's model.py and train.py are: token and
position embeddings, the token embedding tied to the output head, q/k/v in one fused Linear (c_attn),
forward(idx, targets=None) returning (logits, loss) and only the last position's logits without targets, batches
drawn with torch.randint from one token stream.

    python nanogpt.py                                            # the unported script, one process
    ddpkit run --nproc-per-node 2 nanogpt.py --port tp           # prepare(tp=2, tp_plan=MLP plan) + clipping
    ddpkit run --nproc-per-node 2 nanogpt.py --port tp-fused     # + the attention's fused q/k/v split head-wise
    ddpkit run --nproc-per-node 2 nanogpt.py --port pp           # prepare(pp=2)
    ... --port tp-colwise-qkv / tp-typo                          # plans ddpkit refuses in one line

It prints the validation loss after the last step on one line: `val loss X`.
"""

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)
        hs = C // self.n_head
        # q, k, v and the number of heads taken from the tensor: under tensor parallelism c_attn gives this rank
        # its own heads (ddpkit's FusedColwiseParallel), and the same code runs unsplit in one process
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        k = k.view(B, T, -1, hs).transpose(1, 2) # (B, nh, T, hs)
        q = q.view(B, T, -1, hs).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, -1, hs).transpose(1, 2) # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1) # re-assemble all head outputs side by side
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc    = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu    = nn.GELU()
        self.c_proj  = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    bias: bool = True


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte = nn.Embedding(config.vocab_size, config.n_embd),
            wpe = nn.Embedding(config.block_size, config.n_embd),
            h = nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f = nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02/math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device) # shape (t)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :]) # note: using list [-1] to preserve the time dim
            loss = None
        return logits, loss


# -----------------------------------------------------------------------------
# the training loop

parser = argparse.ArgumentParser()
parser.add_argument("--port", default="none", choices=["none", "tp", "tp-fused", "tp-colwise-qkv", "tp-typo", "pp"])
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

batch_size, block_size, learning_rate, grad_clip = 8, 16, 3e-3, 1.0
g = torch.Generator().manual_seed(1337)
data = (torch.arange(4000) * 7 + torch.randint(0, 3, (4000,), generator=g)) % 64 # a learnable token stream
train_data, val_data = data[:3600], data[3600:]

def get_batch(split):
    data = train_data if split == 'train' else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i+block_size] for i in ix])
    y = torch.stack([data[i+1:i+1+block_size] for i in ix])
    return x, y

torch.manual_seed(1337)
model = GPT(GPTConfig(block_size=block_size))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
val_batches = [get_batch('val') for _ in range(4)] # a fixed validation set

master_process = True
if args.port == "none":
    clip = torch.nn.utils.clip_grad_norm_
else:
    import ddpkit
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from ddpkit.parallel.mesh.tp_plan import FusedColwiseParallel

    clip = ddpkit.clip_grad_norm_
    plan = {"transformer.h.*.mlp.c_fc": ColwiseParallel(), "transformer.h.*.mlp.c_proj": RowwiseParallel()}
    if args.port == "tp-fused":
        plan["transformer.h.*.attn.c_attn"] = FusedColwiseParallel(chunks=3)
        plan["transformer.h.*.attn.c_proj"] = RowwiseParallel()
    elif args.port == "tp-colwise-qkv":
        plan["transformer.h.*.attn.c_attn"] = ColwiseParallel()
    elif args.port == "tp-typo":
        plan = {"transformer.h.*.mlp.fc": ColwiseParallel()}
    if args.port.startswith("tp"):
        model, optimizer = ddpkit.prepare(model, optimizer, tp=2, tp_plan=plan)
    else:
        class Logits(nn.Module): # prepare(pp=...) takes a model that returns every position's logits
            def __init__(self, gpt):
                super().__init__()
                self.gpt = gpt
            def forward(self, idx): # GPT.forward without the targets branch
                t = self.gpt.transformer
                x = t.wte(idx) + t.wpe(torch.arange(idx.size(1), device=idx.device))
                for block in t.h:
                    x = block(x)
                return self.gpt.lm_head(t.ln_f(x))

        model, optimizer = ddpkit.prepare(
            Logits(model), optimizer, pp=2, pp_split=["gpt.transformer.h.1"], pp_microbatches=2,
            loss_fn=lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
        )
    master_process = ddpkit.is_main_process()

for it in range(args.steps):
    X, Y = get_batch('train')
    if args.port == "pp":
        loss = model.step(X, Y)
    else:
        logits, loss = model(X, Y)
        loss.backward()
    clip(model, grad_clip) if args.port != "none" else clip(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master_process:
        print(f"iter {it}: loss {loss.item():.6f}")

with torch.no_grad():
    if args.port == "pp":
        val_loss = model.evaluate(val_batches)
    else:
        val_loss = sum(model(X, Y)[1].item() for X, Y in val_batches) / len(val_batches)
if master_process:
    print(f"val loss {val_loss:.6f}")
