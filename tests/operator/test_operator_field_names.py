"""Every message the operator writes about a settings field names it as the CR does
(`spec.loader.memoryLimitBytes`, see `support.field_names`): the operator reads only CRs, so its
namer is the contract's `cr_names`. Each is driven through `parse_spec` and the pod rules, as
the handlers and `dlo render` call them."""

from __future__ import annotations

from typing import Any

import pytest
from support.field_names import CR_ORIGIN, Case, check, text_of

from dlo_contract.errors import DloError
from dlo_operator.pod_rules import pod_problems
from dlo_operator.spec import parse_spec

MINIMAL: dict[str, Any] = {"model": {"source": "s3://models/flux/"},
                           "inference": {"image": "server:1"}}


def _refused(spec: dict[str, Any]) -> str:
    with pytest.raises(DloError) as caught:
        parse_spec(spec)
    return text_of(caught.value)


def _problems(**sections: Any) -> str:
    problems = pod_problems(parse_spec({**MINIMAL, **sections}))
    assert problems
    return "; ".join(problems)


CASES = (
    Case("source-missing", ("loader.source",),
         lambda env, o: _refused({"inference": {"image": "server:1"}})),
    Case("bound", ("loader.readers",),
         lambda env, o: _refused({**MINIMAL, "loader": {"readers": 0}})),
    Case("wrong-type", ("loader.chunk_bytes",),
         lambda env, o: _refused({**MINIMAL, "loader": {"chunkBytes": "big"}})),
    Case("two-chunks", ("loader.memory_limit_bytes", "loader.chunk_bytes"),
         lambda env, o: _refused({**MINIMAL, "loader": {"memoryLimitBytes": 1 << 20}})),
    Case("rule", ("parallel.hsdp", "offload.use_allgather"),
         lambda env, o: _refused({**MINIMAL, "parallel": {"hsdp": True}})),
    Case("loader-memory-over-container", ("loader.memory_limit_bytes",),
         lambda env, o: _problems(loader={"resources": {"limits": {"memory": "512Mi"}}})),
    Case("loader-backend", ("loader.backend",),
         lambda env, o: _problems(loader={"backend": "nccl"})),
    Case("metrics-port-clash", ("loader.metrics_port",),
         lambda env, o: _problems(loader={"metricsPort": 29500})),
    Case("runtime-cache-apart", ("offload.runtime_cache_root", "cache.root"),
         lambda env, o: _problems(offload={"useAllgather": False, "enableRuntimeCache": True,
                                           "runtimeCacheRoot": "/var/lib/dlo/cache/runtime"})),
    Case("source-form", ("loader.source",),
         lambda env, o: _refused({**MINIMAL, "model": {"source": "hf://org"}})),
    Case("source-share-path", ("loader.source",),
         lambda env, o: _problems(model={"source": "file:///etc/m/", "share": {
             "volumeName": "w"}}, volumes=[{"name": "w", "emptyDir": {}}])),
)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_operator_names_each_field_as_the_cr_does(case: Case) -> None:
    check(case, None, CR_ORIGIN)
