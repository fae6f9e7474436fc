"""The node cache, format v1: one content-addressed store per node, shared by every pod.

This package is the contract between the loader (which publishes checkpoint entries), the runtime
(which maps them and publishes runtime entries) and the `dlo cache` commands. It uses the standard
library only (awscrt, isal or xxhash only to hash entries that name those digests): no torch,
boto3 or kopf. Layout and protocol: docs/design.md section 4.

    entry = entry_id(identity)
    path = publish_entry(root, entry, "checkpoint", identity, write, expected_bytes=n,
                         lock_timeout_s=600)
    with open_entry(root, entry) as handle:      # holds .use shared while mapped
        ... handle.file_path("model.safetensors") ...
"""

from dlo_contract.cache.check import Problem
from dlo_contract.cache.digest import (
    CHUNKED_THRESHOLD,
    CRC_ALGORITHMS,
    DEFAULT_CHUNK_BYTES,
    chunk_digests,
    combine_crc,
    crc_function,
    crc_hex,
    file_digest,
    file_record,
    hexdigest,
    sha256_file,
)
from dlo_contract.cache.entry import EntryHandle, find_entry, open_entry, verify_entry
from dlo_contract.cache.errors import (
    CacheCorruptError,
    CacheError,
    CacheLockTimeout,
    CacheSpaceError,
    remove_command,
)
from dlo_contract.cache.evict import EntryInfo, evict, list_entries, remove_entry
from dlo_contract.cache.identity import (
    ObjectIdentity,
    canonical_json,
    checkpoint_identity,
    entry_id,
    runtime_identity,
)
from dlo_contract.cache.layout import MANIFEST_NAME, CacheRoot, safe_relpath
from dlo_contract.cache.manifest import MANIFEST_SCHEMA_VERSION, FileRecord, Manifest, read_manifest
from dlo_contract.cache.publish import Publication, begin_publication, publish_entry
from dlo_contract.cache.reservation import FillInProgress, in_progress
from dlo_contract.cache.room import RoomLimits, make_room

__all__ = [
    "CHUNKED_THRESHOLD",
    "DEFAULT_CHUNK_BYTES",
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA_VERSION",
    "CacheCorruptError",
    "CacheError",
    "CacheLockTimeout",
    "CacheRoot",
    "CacheSpaceError",
    "EntryHandle",
    "EntryInfo",
    "FileRecord",
    "FillInProgress",
    "Manifest",
    "ObjectIdentity",
    "Problem",
    "Publication",
    "RoomLimits",
    "begin_publication",
    "canonical_json",
    "checkpoint_identity",
    "chunk_digests",
    "CRC_ALGORITHMS",
    "combine_crc",
    "crc_function",
    "crc_hex",
    "entry_id",
    "evict",
    "file_digest",
    "file_record",
    "find_entry",
    "hexdigest",
    "in_progress",
    "list_entries",
    "make_room",
    "open_entry",
    "publish_entry",
    "read_manifest",
    "remove_command",
    "remove_entry",
    "runtime_identity",
    "safe_relpath",
    "sha256_file",
    "verify_entry",
]
