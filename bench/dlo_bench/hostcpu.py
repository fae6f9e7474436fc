"""The whole machine's CPU over a stretch of a benchmark: how busy it was, how long it sat idle,
and how much of it the hypervisor took (steal).

Owns reading and dividing the kernel's CPU counters (`/proc/stat`, summed over all CPUs). Used by
`dlo_bench.cluster` (each fill, release to last exit) and `dlo_bench.loader` (each measured run),
so that a figure says whether the machine had room to spare while it was taken. Stdlib only;
where the counters cannot be read (not Linux), every reading is None and the reports say so.

[Note: steal] On a virtual machine, CPU time the hypervisor gives to something else while a CPU
of this machine had work is counted as steal. It is not the machine's own load, yet it grows
with it: device I/O and every wakeup of a sleeping CPU (a timer, an interrupt sent to wake
another CPU) leave the guest for the hypervisor, and the simulated cluster's shaped links and
socket traffic make many. A fill that took longer while idle was near zero and steal high was
bounded by the machine, not by the links it models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

_STAT = Path("/proc/stat")
_BUSY = ("user", "nice", "system", "irq", "softirq")
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
"""The first eight counters of the `cpu` line, in the kernel's order (guest time is already in
user and nice)."""


@dataclass(frozen=True)
class HostCpu:
    """Fractions of all CPU time of the machine over a stretch; they sum to 1."""

    busy: float
    """This machine's own work: user, nice, system, irq and softirq."""
    idle: float
    """Nothing to run (idle and iowait)."""
    steal: float
    """Taken by the hypervisor while this machine had work (see [Note: steal])."""

    def as_dict(self) -> dict[str, float]:
        return {name: round(value, 3) for name, value in asdict(self).items()}

    def describe(self) -> str:
        return f"busy {self.busy:.0%}, idle {self.idle:.0%}, steal {self.steal:.0%}"


def read_times(stat: Path = _STAT) -> tuple[int, ...] | None:
    """The machine's CPU counters in `_FIELDS` order (clock ticks since boot), or None where the
    file cannot be read."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu":
        return None
    values = [int(value) for value in first[1:1 + len(_FIELDS)]]
    return tuple(values + [0] * (len(_FIELDS) - len(values)))  # old kernels lack steal


def between(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> HostCpu | None:
    """What the machine did between two readings; None when either is missing or no tick
    passed."""
    if before is None or after is None:
        return None
    spent = dict(zip(_FIELDS, (b - a for a, b in zip(before, after))))
    total = sum(spent.values())
    if total <= 0:
        return None
    return HostCpu(busy=sum(spent[name] for name in _BUSY) / total,
                   idle=(spent["idle"] + spent["iowait"]) / total,
                   steal=spent["steal"] / total)


class HostCpuMeter:
    """Over a `with` block: `result`, the machine's `HostCpu` (None where unreadable)."""

    def __init__(self) -> None:
        self.result: HostCpu | None = None
        self._before: tuple[int, ...] | None = None

    def __enter__(self) -> HostCpuMeter:
        self._before = read_times()
        return self

    def __exit__(self, *exc: object) -> None:
        self.result = between(self._before, read_times())
