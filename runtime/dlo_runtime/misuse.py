"""Refuses, before anything changes, to enable DLO on a model it cannot stream correctly.

Owns the checks `enable` runs first, each raising `OffloadError` with a message that names the
module and what to do:
- the model is already offloaded by DLO (`dlo_runtime.is_enabled`), or a backend disabled it
  with `restore=False`, so its streamed tensors are empty placeholders;
- the model carries diffusers' group-offloading hooks or accelerate hooks (`cpu_offload`,
  `enable_model_cpu_offload`, `enable_sequential_cpu_offload`, a `device_map` dispatch): two
  offloaders would move the same weights behind each other's back;
- parameters or buffers are on the meta device, or empty, while no host weight plan backs them.
Without these checks the failure comes later, deep inside the model's forward, with no frame of
ours in the traceback. Called by the backend's `enable` and by `pod.enable` (only
`refuse_unbacked` when offload is disabled); it must not change the model.
"""

from __future__ import annotations

import enum
from torch import nn

from dlo_runtime.tensors import OffloadError

MARK_ATTRIBUTE = "_dlo_offload_state"
"""Set on a DiT by the backend: the `OffloadMark` of its tensors (see `dlo_runtime.is_enabled`)."""
DIFFUSERS_REGISTRY = "_diffusers_hook"
DIFFUSERS_OFFLOAD_HOOKS = frozenset(
    {"group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading"}
)
"""Names diffusers' `apply_group_offloading` registers its hooks under."""
ACCELERATE_HOOK = "_hf_hook"
"""Attribute accelerate's `add_hook_to_module` sets (cpu offload, device_map dispatch)."""


class OffloadMark(enum.Enum):
    """What DLO left on a DiT's tensors."""

    ENABLED = "enabled"
    """A backend streams it now."""
    RELEASED = "released"
    """Disabled with `restore=False` (shutdown): its streamed tensors are empty placeholders."""


def refuse_misuse(dit: nn.Module, *, host_plan: bool) -> None:
    """Raise `OffloadError` when DLO must not be enabled on `dit`; see the module docstring."""
    name = type(dit).__name__
    mark = getattr(dit, MARK_ATTRIBUTE, None)
    if mark is OffloadMark.ENABLED:
        raise OffloadError(
            f"{name} is already offloaded by dlo",
            hint="call disable() on its backend (or close() on its handle) before enabling "
            "it again, or keep using the enabled one",
        )
    if mark is OffloadMark.RELEASED:
        raise released_error(name, "enable it again")
    for path, module in dit.named_modules():
        where = f"{name}.{path}" if path else name
        registry = getattr(module, DIFFUSERS_REGISTRY, None)
        hooks = sorted(DIFFUSERS_OFFLOAD_HOOKS & set(getattr(registry, "hooks", {})))
        if hooks:
            raise OffloadError(
                f"{where} carries diffusers offloading hooks ({', '.join(hooks)}); DLO and "
                "group offloading would both move its weights",
                hint="load the model without enable_group_offload()/apply_group_offloading(), "
                "or remove the hooks (HookRegistry.remove_hook) before enabling DLO",
            )
        if getattr(module, ACCELERATE_HOOK, None) is not None:
            raise OffloadError(
                f"{where} carries an accelerate hook ({type(module._hf_hook).__name__}); "
                "DLO and accelerate offloading would both move its weights",
                hint="do not call enable_model_cpu_offload()/enable_sequential_cpu_offload() "
                "or load with device_map on a model DLO streams, or remove the hooks "
                "(accelerate.hooks.remove_hook_from_module(module, recurse=True))",
            )
    if not host_plan:
        refuse_unbacked(dit)


def released_error(name: str, then: str) -> OffloadError:
    """What enabling (`then`: "enable it again") or calling (`dlo_runtime.forward_gate`) a DiT
    disabled with `restore=False` raises."""
    return OffloadError(
        f"{name} was disabled with restore=False, so its streamed tensors are empty "
        "placeholders",
        hint=f"load the model again, or disable with restore=True to {then}",
    )


def refuse_unbacked(dit: nn.Module) -> None:
    """Raise `OffloadError` for meta or empty tensors with no host weight plan: there is nothing
    to stream from, or (`pod.enable` with offload disabled) to keep resident."""
    name = type(dit).__name__
    for tensor_name, tensor in dit.state_dict(keep_vars=True).items():
        if tensor.is_meta:
            raise OffloadError(
                f"{name}.{tensor_name} is on the meta device and no host weight plan backs it",
                hint="load the weights first (from_pretrained), or build the DiT with "
                "pod.build_dit() and enable it with pod.enable() in a pod that ran the loader",
            )
        if tensor.numel() == 0:
            raise OffloadError(
                f"{name}.{tensor_name} is an empty tensor (a placeholder with no weights) and "
                "no host weight plan backs it",
                hint="load the weights again before enabling DLO",
            )
