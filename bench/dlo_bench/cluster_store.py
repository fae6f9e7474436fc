"""The object-store side of `dlo bench cluster`, run inside the store namespace.

`python -m dlo_bench.cluster_store --ministack BIN --host ADDR --port P --bucket B --prefix K DIR`
starts ministack bound to the store namespace's address (not loopback, so that the node
namespaces reach it), uploads DIR under `s3://B/K/`, reads once (see `_first_read`), prints one
JSON line `{"endpoint_url", "keys", "bytes", "python"}` (`python`: the server's version), then
serves until its standard input closes and stops the server. Tying the server's life to a pipe
from `dlo_bench.cluster` means a benchmark that dies for any reason never leaves a server behind
in a deleted namespace. It must not shape traffic or create namespaces (`dlo_bench.netns` does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dlo_bench.s3server import S3Server, start_ministack, upload_tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlo_bench.cluster_store")
    parser.add_argument("--ministack", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    server = start_ministack(args.ministack, args.port, host=args.host)
    try:
        keys = upload_tree(server, args.bucket, args.prefix, args.directory)
        _first_read(server, args.bucket, keys[0])
        size = sum(p.stat().st_size for p in args.directory.rglob("*") if p.is_file())
        print(json.dumps({"endpoint_url": server.endpoint_url, "keys": keys, "bytes": size,
                          "python": server.python}), flush=True)
        sys.stdin.read()  # serve until the benchmark closes the pipe (or dies)
    finally:
        server.stop()
    return 0


def _first_read(server: S3Server, bucket: str, key: str) -> None:
    """ministack answers its first read after the uploads late, a warm-up of its own (later
    reads take milliseconds): read once before any fill is timed, so that the first fill of a
    run does not pay what the others do not."""
    client = server.client()
    client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    client.get_object(Bucket=bucket, Key=key, Range="bytes=0-0")["Body"].read()


if __name__ == "__main__":
    sys.exit(main())
