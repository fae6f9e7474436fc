"""Which forwards of an offloaded DiT run: one at a time, and none that needs a backward.

Owns `ForwardGate`, a pair of hooks on the DiT itself that the backend installs with the block
hooks. The streamed blocks share one `BlockScheduler` (which slot holds which block, where every
streamed tensor's `.data` points), so two forwards whose blocks interleave would release or
overwrite each other's slots and compute with another block's weights, or with placeholders:
- a forward from another thread waits until the one in flight has returned or raised (a
  threaded server may send every request to one pipeline; they run one after the other);
- a forward of the DiT from inside its own forward (a hook or callback that calls it again on
  the same thread) is refused with `OffloadError`: waiting for itself would never end;
- a forward with grad mode on whose inputs require grad (gradient-based guidance) is refused with
  `OffloadError` before anything runs: DLO streams weights for inference only, and the post-hooks
  point the weights autograd saved at empty placeholders, so its backward would fail with a
  shape error far from the cause. Grad mode alone (no input requiring grad) is not refused:
  diffusers pipelines may call the DiT that way, and no backward follows;
- a forward of a DiT disabled with `restore=False` (`OffloadHandle.close()`) is refused with
  `OffloadError` (`refuse_released`): its streamed tensors are empty placeholders, and torch
  would fail in the first block with a shape error (`mat2 must be a matrix`).
Called by `installed_hooks` (attach, detach) and `teardown` (refuse_released); it must not touch
slots, tensors or process groups.

[Note: forward lock] The lock is taken by the DiT's first forward pre-hook and released by its
forward hook registered with `always_call=True`, which torch calls when the forward returns and
when anything in it raises, a pre-hook included: so a refused nested call reaches `_leave` too,
on the thread that holds the lock, and must not release the outer forward's lock. In AllGather
mode each rank serializes its own forwards; the lock adds no collective, and the ranks still
issue their loads in the order their forwards run them (see [Note: collective order] in
`dlo_runtime.hooks`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo_runtime.compiled import outside_compiled_graphs
from dlo_runtime.misuse import released_error
from dlo_runtime.tensors import OffloadError


class ForwardGate:
    """Admits one forward of one offloaded DiT at a time; see the module docstring."""

    def __init__(self, name: str) -> None:
        self._name = name
        """The DiT's class name, for messages."""
        self._lock = threading.Lock()
        self._owner: int | None = None
        """Thread id of the forward holding the lock."""
        self._refused = 0
        """Nested calls refused on the owner's thread whose `_leave` has not run yet."""
        self._handles: list[RemovableHandle] = []

    def attach(self, dit: nn.Module) -> None:
        """Install the hooks: the pre-hook before any other, the release after the DiT's other
        forward hooks (the backend attaches its step hook first, so it runs under the lock)."""
        self._handles = [
            dit.register_forward_pre_hook(self._enter, prepend=True, with_kwargs=True),
            dit.register_forward_hook(self._leave, always_call=True),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @outside_compiled_graphs
    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        here = threading.get_ident()
        if self._owner == here:
            self._refused += 1
            raise OffloadError(
                f"{self._name} was called from inside its own forward; DLO streams one forward "
                "of a DiT at a time, and the nested one would take the device slots of the "
                "blocks the outer one is running",
                hint="call the DiT again after its forward has returned (forwards from other "
                "threads wait for it; the same thread's cannot)",
            )
        _refuse_backward(self._name, args, kwargs)
        # The scheduler's slots and the streamed tensors' storage belong to one forward.
        self._lock.acquire()
        self._owner = here

    @outside_compiled_graphs
    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._owner != threading.get_ident():
            return  # refused before it took the lock; the lock is another forward's
        if self._refused:
            self._refused -= 1  # a nested call's refusal ends here (see [Note: forward lock])
            return
        self._owner = None
        self._lock.release()


def refuse_released(dit: nn.Module) -> None:
    """After `disable(restore=False)`: every later forward of `dit` raises `OffloadError`, before
    any other hook runs (the hook stays; the DiT cannot be enabled again either)."""

    @outside_compiled_graphs
    def released(module: nn.Module, args: Any) -> None:
        raise released_error(type(module).__name__, "keep running it")

    dit.register_forward_pre_hook(released, prepend=True)


def _refuse_backward(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise `OffloadError` when grad mode is on and an input requires grad; see the module
    docstring."""
    if not torch.is_grad_enabled():
        return
    inputs = [(f"argument {i}", value) for i, value in enumerate(args)] + list(kwargs.items())
    for where, value in inputs:
        if any(tensor.requires_grad for tensor in _tensors(value)):
            raise OffloadError(
                f"{name} was called with grad enabled and its input {where} requires grad; DLO "
                "streams weights for inference only (after each block they are empty "
                "placeholders), so no backward through the DiT can run",
                hint="run the forward under torch.no_grad() or torch.inference_mode(), or pass "
                "detached inputs",
            )


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, looking into tuples, lists and dicts (a call's nested inputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []
