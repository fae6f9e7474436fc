"""Small hand-written DiTs for the runtime tests: one that declares its own offload plan (two
block lists of different classes and sizes, a float64 persistent buffer, a non-persistent one),
one that declares on-demand modules, and one that relies on the heuristic."""

from __future__ import annotations

import torch
from torch import nn


class MlpBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim, dtype=torch.float64))
        self.register_buffer("bias_cache", torch.full((dim,), 0.25), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.down(torch.relu(self.up(self.norm(x))))
        return x + update * self.scale.to(x.dtype) + self.bias_cache


class GateBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sigmoid(self.gate(x)) * self.value(x)


class DeclaredDiT(nn.Module):
    """Declares its plan as a mapping: two lists, resident blocks only from `stem`."""

    _dlo_offload_plan = {"blocks": ["stem", "head"], "resident": ["stem"]}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.stem = nn.ModuleList([MlpBlock(16, 32), MlpBlock(16, 96), MlpBlock(16, 48)])
        self.head = nn.ModuleList([GateBlock(16), GateBlock(16)])
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in [*self.stem, *self.head]:
            x = block(x)
        return self.out(x)


class OnDemandDiT(nn.Module):
    """Declares a large token embedding and a refiner (with a float64 persistent buffer and a
    non-persistent one) as on-demand: on the device only while they run."""

    _dlo_offload_plan = {"blocks": ["layers"], "on_demand": ["embed", "refiner"]}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.refiner = MlpBlock(16, 64)
        self.layers = nn.ModuleList([MlpBlock(16, 32) for _ in range(3)])
        self.out = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.refiner(self.embed(tokens))
        for block in self.layers:
            x = block(x)
        return self.out(x)


class UndeclaredDiT(nn.Module):
    """No plan: the heuristic must pick `layers` (the largest list of same-class blocks), not
    `adapters` (smaller) nor `mixed` (two classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MlpBlock(16, 64) for _ in range(3)])
        self.adapters = nn.ModuleList([GateBlock(16) for _ in range(2)])
        self.mixed = nn.ModuleList([MlpBlock(16, 256), GateBlock(16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.layers, *self.adapters, *self.mixed]:
            x = block(x)
        return x


def seeded(cls: type[nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls().eval()


def on_demand_inputs() -> dict[str, torch.Tensor]:
    """Forward kwargs of `OnDemandDiT`: a fixed batch of token ids."""
    return {"tokens": torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))}
