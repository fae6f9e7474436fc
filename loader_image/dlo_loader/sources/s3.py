"""`s3://bucket/prefix/`: S3 and S3-compatible stores, read with botocore (`dlo_loader.source`,
with its listing, bodies and checksums in `source_listing` and `source_body`)."""

from __future__ import annotations

from dlo_loader.source import open_source

__all__ = ["open_source"]
