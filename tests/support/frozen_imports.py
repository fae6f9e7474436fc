"""Imported once by a test process (the runtime tests' conftest, the gloo fork server): the heavy
modules every runtime test needs (torch, dynamo, inductor, the runtime, the diffusers DiTs), then
`gc.freeze()`, so that no later collection walks their objects again.

The runtime collects garbage at every `enable` and `disable` (the replaced weights may sit in
reference cycles); with these modules loaded a full collection walks some 400,000 objects, about
0.3 s each time on a CI core, most of a small test's run. Frozen objects are those alive at
import time only: what a test builds is collected as before. Import it last, after the process
imported what it needs."""

from __future__ import annotations

import gc

import diffusers.models.transformers.transformer_flux  # noqa: F401
import diffusers.models.transformers.transformer_sd3  # noqa: F401
import diffusers.models.transformers.transformer_wan  # noqa: F401
import support.compiled_helpers  # noqa: F401
import support.runtime_helpers  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401

gc.freeze()
