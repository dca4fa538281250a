"""The stager of background saves on a CPU: a torch AsyncStager (torch.distributed.checkpoint.staging) that copies
each save's tensors, in a thread of its own, into copies it keeps between saves, with `Tensor.copy_`.

torch's DefaultStager does the same through its StateDictStager, which copies each storage with
`UntypedStorage.copy_`: that call holds the GIL for the whole copy (a Python loop in another thread runs at about
0.1 of its speed meanwhile, at 1.0 beside `Tensor.copy_`), so on a CPU, where the copy is a memcpy of the whole
state, the staging thread holds up the training thread it is meant to run beside. On a GPU the copies are
device-to-host transfers that return at once (pinned memory, a stream of their own): the trainer keeps
DefaultStager there. The copies are made by torch's own helpers for this (`_create_cpu_state_dict` at the first
save or when the tensors' shapes change, `_copy_state_dict` at every save; DTensors keep their placements).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager


class HostCopies(AsyncStager):
    """stage() returns a Future of the copied state dict; close() frees the copies (after the staging in flight).
    The copies are overwritten by the next save: a caller keeps at most one save in flight."""

    _synchronize_after_execute = False  # the caller waits for the Future (before its optimizer step)

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpkit-staging")
        self._copies: dict[str, Any] | None = None
        self._layout: dict[str, tuple] | None = None

    def stage(self, state_dict: dict[str, Any]) -> Future:
        return self._pool.submit(self._stage, state_dict)

    @torch.no_grad()
    def _stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = {k: (tuple(v.shape), v.dtype, type(v)) for k, v in state_dict.items()}
        if layout != self._layout:  # the first save (a run's tensors keep their shapes)
            copies = _create_cpu_state_dict(state_dict)
            for k, v in state_dict.items():
                if copies[k] is v:  # torch's helper keeps a 0-dim DTensor itself: a copy of its own
                    copies[k] = v.detach().clone()
            self._copies, self._layout = copies, layout
        return _copy_state_dict(state_dict, self._copies)

    def synchronize_staging(self) -> None:
        """Nothing: the Future that stage() returns says when the copies are made."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._copies = self._layout = None
