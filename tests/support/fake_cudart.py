"""A stand-in for the CUDA runtime at the very bottom of registration (`cuda_registration.Cudart`).

It keeps the set of registered ranges the way the runtime does, answers pointer queries from it,
records every call, and fails on request: the Nth register call, or every unregister call.
"""

from __future__ import annotations

from dlo_runtime.cuda_registration import MEMORY_TYPE_HOST

ERROR_MEMORY_ALLOCATION = 2
ERROR_HOST_MEMORY_NOT_REGISTERED = 713


class FakeCudart:
    def __init__(self, *, fail_register_call: int | None = None, fail_unregister: bool = False,
                 read_only_supported: bool = True, pinned_answer: bool = True) -> None:
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}
        self._fail_register_call = fail_register_call
        self.fail_unregister = fail_unregister
        self._read_only_supported = read_only_supported
        self._pinned_answer = pinned_answer

    def host_register(self, address: int, length: int, flags: int) -> int:
        self.calls.append(("register", address, length, flags))
        if sum(c[0] == "register" for c in self.calls) == self._fail_register_call:
            return ERROR_MEMORY_ALLOCATION
        self.registered[address] = length
        return 0

    def host_unregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        if self.fail_unregister or address not in self.registered:
            return ERROR_HOST_MEMORY_NOT_REGISTERED
        del self.registered[address]
        return 0

    def device_attribute(self, attribute: int, device: int) -> tuple[int, int]:
        self.calls.append(("attribute", attribute, device))
        return 0, int(self._read_only_supported)

    def memory_type(self, address: int) -> tuple[int, int]:
        inside = any(start <= address < start + n for start, n in self.registered.items())
        return 0, MEMORY_TYPE_HOST if inside and self._pinned_answer else 0

    def error_string(self, code: int) -> str:
        return {ERROR_MEMORY_ALLOCATION: "out of memory",
                ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered "
                                                  "memory region"}[code]

    def platform_calls(self) -> list[tuple]:
        return [c for c in self.calls if c[0] in ("register", "unregister")]
