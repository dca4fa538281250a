"""dist.grad_compression=powersgd: torch's PowerSGD hook, and the state a checkpoint must carry so a resumed run
continues exactly (error feedback, warm-start factors, step counter and random stream)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _plan(state: Any, shapes: list[torch.Size]) -> list[tuple[int, int, int] | None]:
    """For each gradient of a bucket, in order: (n, m, rank) of the matrix PowerSGD compresses, or None when it
    sends the tensor as it is (the decision torch's powerSGD_hook makes)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    plan: list[tuple[int, int, int] | None] = []
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = int(torch.Size(shape).numel()) // max(n, 1)
        r = min(n, m, state.matrix_approximation_rank)
        plan.append((n, m, r) if _should_compress(n, m, r, state.min_compression_rate)[0] else None)
    return plan


def _factor_slices(plan: list[tuple[int, int, int] | None]) -> tuple[list, list]:
    """Per gradient, its (start, end) in the bucket's P and Q memory (None when not compressed): torch lays the
    factors out by shape, in the order each shape first appears in the bucket."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, item in enumerate(plan):
        if item is not None:
            groups.setdefault(item[:2], []).append(i)
    p_at: list = [None] * len(plan)
    q_at: list = [None] * len(plan)
    p = q = 0
    for members in groups.values():
        for i in members:
            n, m, r = plan[i]  # type: ignore[misc]
            p_at[i], q_at[i] = (p, p + n * r), (q, q + m * r)
            p, q = p + n * r, q + m * r
    return p_at, q_at


class PowerSGDHook:
    """torch's powerSGD_hook, whose state follows the parameters when DDP re-buckets them.

    PowerSGD keeps its error feedback and warm-start factors per bucket, laid out in the bucket's parameter
    order. A DDP module buckets its gradients one way in its first iteration and another way after (it rebuilds
    the buckets in the order gradients become ready), so a resumed run meets the saved state in other buckets,
    and its own state moves when it rebuilds. Here the state is split per parameter whenever the layout
    changes (and for a checkpoint), and put together again in whatever buckets come next.
    """

    def __init__(self, state: Any, names: dict[int, str]):
        self.state = state
        self.names = names  # id(parameter) -> its name in the model
        # On gloo the buckets go one at a time: torch's hook issues a bucket's second all-reduce from a callback
        # thread, and gloo needs every rank to issue its collectives in the same order.
        self.serial = torch.distributed.get_backend(state.process_group) == "gloo"
        self._previous: Any = None  # the last bucket's future (serial only)
        self.layout: dict[
            int, tuple[list[str], list[torch.Size]]
        ] = {}  # the layout each bucket's state is in
        self.pool: dict[str, dict[str, torch.Tensor]] = {}  # per-parameter state waiting for its new bucket

    def hook(self, state, bucket):  # no annotations: DDP checks them against its own types
        """The communication hook: move the state to this bucket's layout, then torch's powerSGD_hook."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        index = bucket.index()
        params = bucket.parameters()
        layout = ([self.names[id(p)] for p in params], [p.shape for p in params])
        known = self.layout.get(index)
        if known is not None and known[0] != layout[0]:  # DDP rebuilt its buckets: free every bucket's state
            for i in list(self.layout):
                self.pool.update(self._split(i))
            self.layout.clear()
        self.layout[index] = layout
        if self.pool and index not in self.state.error_dict:
            self._assemble(index, bucket.buffer().device)
        if self.serial and self._previous is not None:
            self._previous.wait()  # the previous bucket's collectives have all been issued and done
        future = powerSGD_hook(state, bucket)
        if self.serial:
            self._previous = future
        return future

    def _split(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket `index`'s state cut per parameter (and removed from the bucket)."""
        st = self.state
        if index not in st.error_dict:
            return {}
        names, shapes = self.layout[index]
        p_at, q_at = _factor_slices(_plan(st, shapes))
        error, p_mem, q_mem = (
            st.error_dict.pop(index),
            st.p_memory_dict.pop(index, None),
            st.q_memory_dict.pop(index, None),
        )
        pieces, offset = {}, 0
        for i, (pname, shape) in enumerate(zip(names, shapes, strict=True)):
            numel = int(torch.Size(shape).numel())
            piece = {"error": error[offset : offset + numel].detach().clone()}
            offset += numel
            if p_at[i] is not None and p_mem is not None:
                piece["p"] = p_mem[slice(*p_at[i])].detach().clone()
                piece["q"] = q_mem[slice(*q_at[i])].detach().clone()  # type: ignore[index]
            pieces[pname] = piece
        return pieces

    def _assemble(self, index: int, device: torch.device) -> None:
        """Bucket `index`'s state put together from the pool (when the pool holds all of its parameters)."""
        names, shapes = self.layout[index]
        if not all(n in self.pool for n in names):
            return  # parameters the state never covered: PowerSGD starts this bucket afresh
        pieces = [self.pool.pop(n) for n in names]
        st = self.state
        errors = [
            p.get("error", torch.zeros(int(torch.Size(sh).numel())))
            for p, sh in zip(pieces, shapes, strict=True)
        ]
        st.error_dict[index] = torch.cat(errors).to(device)
        p_at, _ = _factor_slices(_plan(st, shapes))
        order = [i for _, i in sorted((at[0], i) for i, at in enumerate(p_at) if at is not None)]
        if order and all("p" in pieces[i] for i in order):
            st.p_memory_dict[index] = torch.cat([pieces[i]["p"] for i in order]).to(device)
            st.q_memory_dict[index] = torch.cat([pieces[i]["q"] for i in order]).to(device)

    def state_dict(self) -> dict[str, Any]:
        """Per-parameter state (the live buckets' and what waits in the pool), step counter and random stream."""
        st = self.state
        per_param = {n: {k: v.cpu() for k, v in piece.items()} for n, piece in self.pool.items()}
        for index in self.layout:
            if index in st.error_dict:
                saved_layout = self.layout[index]
                pieces = self._split(index)
                per_param.update({n: {k: v.cpu() for k, v in p.items()} for n, p in pieces.items()})
                self.pool.update(pieces)  # put it straight back where it was
                self.layout[index] = saved_layout
                self._assemble(index, next(iter(pieces.values()))["error"].device)
        name, keys, pos, has_gauss, cached = st.rng.get_state()
        rng = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
        return {"iter": int(st.iter), "rng": rng, "params": per_param}

    def load_state_dict(self, saved: dict[str, Any], device: torch.device) -> None:
        """Take a state_dict(): its per-parameter state waits in the pool for the buckets of the next step."""
        st = self.state
        st.iter = int(saved["iter"])
        name, keys, pos, has_gauss, cached = saved["rng"]
        st.rng.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            d.clear()
        self.layout.clear()
        self.pool = {n: {k: v.to(device) for k, v in piece.items()} for n, piece in saved["params"].items()}


def register(ddp: torch.nn.Module, options: Any) -> PowerSGDHook:
    """PowerSGD's hook on `ddp` (compression_method.POWERSGD's `register`), with error feedback and warm start."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=options.powersgd_rank,
        start_powerSGD_iter=options.powersgd_warmup_steps,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    hook = PowerSGDHook(state, {id(p): n for n, p in ddp.module.named_parameters()})
    ddp.register_comm_hook(state, hook.hook)
    return hook
