"""Every message the loader writes about a settings field names it as the document's origin
does (see `support.field_names`): each is driven through `fill`, which resolves the namer once
from the settings and hands it down, except where a fill of one loader cannot reach it (a full
disk, an empty listing, a group's buffers), which is driven through the unit the fill hands the
namer to."""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from dlo_bench.faultproxy import FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server, free_port
from dlo_loader.exchange import Exchange
from dlo_loader.fill import FillRequest, fill
from dlo_loader.plan import build_plan
from dlo_loader.progress import Progress
from dlo_loader.source import ObjectStore
from dlo_loader.sources import parse_source
from dlo_contract.cache import ObjectIdentity, checkpoint_identity
from dlo_contract.errors import DloError
from dlo_contract.settings import CacheConfig, LoaderConfig, Settings
from dlo_contract.validation import names_for
from support.field_names import ORIGINS, Case, check, text_of
from support.loader_fleet import LOADER_SETTINGS, Checkpoint

pytestmark = pytest.mark.usefixtures("aws_env")


@dataclass(frozen=True)
class Env:
    s3: S3Server
    checkpoint: Checkpoint
    root: Path


def _settings(env: Env, origin: str | None, cache: dict | None = None,
              **loader: object) -> Settings:
    fields = {**LOADER_SETTINGS, "source": env.checkpoint.source,
              "endpoint_url": env.s3.endpoint_url, **loader}
    return Settings(origin=origin, loader=LoaderConfig(**fields),
                    cache=CacheConfig(root=str(env.root / str(origin)), **(cache or {})))


def _failed_fill(request: FillRequest) -> str:
    with pytest.raises(DloError) as caught:
        fill(request)
    return text_of(caught.value)


def _fill(env: Env, origin: str | None, cache: dict | None = None, **loader: object) -> str:
    return _failed_fill(FillRequest(settings=_settings(env, origin, cache, **loader)))


def _grouped(env: Env, origin: str | None, lines: list[str] | None = None,
             **loader: object) -> str:
    """Rank 1 of 3 whose rank 0 never listens."""
    request = FillRequest(settings=_settings(env, origin, **loader), rank=1, world_size=3,
                          master_addr="127.0.0.1", master_port=free_port(),
                          emit=None if lines is None else lines.append)
    return _failed_fill(request)


def _gives_up(env: Env, origin: str | None) -> str:
    with FaultProxy(env.s3.endpoint_url, FaultPlan(kinds=("slowdown",))) as proxy:
        return _fill(env, origin, endpoint_url=proxy.url, max_retries=2)


def _waiting(env: Env, origin: str | None) -> str:
    lines: list[str] = []
    failed = _grouped(env, origin, lines, rendezvous_timeout_s=0.5,
                      on_rendezvous_timeout="fail")
    return f"{lines[0]}\n{failed}"


def _local_error(code: int):
    def drive(env: Env, origin: str | None) -> str:
        settings = _settings(env, origin)
        store = ObjectStore(parse_source(settings.loader.source), endpoint_url=None,
                            region="us-east-1", path_style=True, readers=1, attempts=2,
                            names=names_for(settings))

        def full() -> None:
            raise OSError(code, "from the test")

        try:
            with pytest.raises(DloError) as caught:
                store.retry.run("reading", full)
        finally:
            store.close()
        return text_of(caught.value)
    return drive


def _group_buffers(env: Env, origin: str | None) -> str:
    """A group of three whose budget holds two chunks: refused before any buffer or read."""
    settings = _settings(env, origin, memory_limit_bytes=LOADER_SETTINGS["chunk_bytes"])
    plan = build_plan([ObjectIdentity("model.safetensors", 1 << 24, "e")], mode="multi-reader",
                      world_size=3, chunk_bytes=settings.loader.chunk_bytes)
    with pytest.raises(DloError) as caught:
        Exchange(plan, rank=1, grouped=True, read=lambda *args: 0, sink=None,
                 progress=Progress(total_bytes=0, prefix=""), config=settings.loader,
                 deadline=float("inf"), stop=threading.Event(), names=names_for(settings))
    return text_of(caught.value)


def _empty_listing(env: Env, origin: str | None) -> str:
    settings = _settings(env, origin)
    with pytest.raises(DloError) as caught:
        checkpoint_identity(settings.loader.source, [], names_for(settings))
    return text_of(caught.value)


CASES = (
    Case("source-unknown-scheme", ("loader.source",),
         lambda env, o: _fill(env, o, source="ftp://x/y")),
    Case("include-matches-nothing", ("loader.include", "loader.source"),
         lambda env, o: _fill(env, o, include=("*.bin",))),
    Case("bucket-not-found", ("loader.source",),
         lambda env, o: _fill(env, o, source="s3://no-such-bucket/x/")),
    Case("store-gives-up", ("loader.max_retries",), _gives_up),
    Case("no-space-on-node", ("loader.readers",), _local_error(errno.ENOSPC)),
    Case("out-of-memory", ("loader.memory_limit_bytes",), _local_error(errno.ENOMEM)),
    Case("group-buffers", ("loader.memory_limit_bytes", "loader.chunk_bytes"), _group_buffers),
    Case("fill-deadline", ("loader.timeout_s",), lambda env, o: _fill(env, o, timeout_s=1e-6)),
    Case("rendezvous-timeout", ("loader.on_rendezvous_timeout",), _waiting),
    Case("entry-over-cache-limit", ("cache.max_bytes", "loader.include"),
         lambda env, o: _fill(env, o, cache={"max_bytes": 1})),
    Case("empty-listing", ("loader.source", "loader.include"), _empty_listing),
)


@pytest.fixture(scope="module")
def env(s3: S3Server, checkpoint: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Env:
    return Env(s3, checkpoint, tmp_path_factory.mktemp("field-names"))


@pytest.mark.parametrize("origin", ORIGINS, ids=("document", "cr"))
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_loader_names_each_field_as_the_documents_origin_does(
        case: Case, origin: str | None, env: Env) -> None:
    check(case, env, origin)
