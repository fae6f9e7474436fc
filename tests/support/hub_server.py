"""A Hugging Face Hub stand-in on loopback for the `hf://` source tests: the Hub's documented
API paths the loader and `huggingface_hub` use, and a separate storage host its LFS files
redirect to.

`HubServer` serves one repository's commits:
- `GET /api/models/{org}/{repo}/revision/{revision}` (`?blobs=true` adds each sibling's size,
  `blobId` and `lfs` {size, sha256, pointerSize}), the answer of `HfApi.model_info`, and
  `GET /api/models/{org}/{repo}` (the same of `main`);
- `GET|HEAD /{org}/{repo}/resolve/{revision}/{path}`: a file stored in git is answered at once
  (ETag: its blob id); an LFS file redirects (302) to the storage host with a signed-looking
  query, after `X-Repo-Commit`, `X-Linked-Etag` (its sha256) and `X-Linked-Size`, as the Hub
  does;
and, with `token`, answers 401 to a request without `Authorization: Bearer <token>`. The storage
host (`cdn`) serves LFS blobs by sha256 with ranges and counts any request that carried an
`Authorization` header (the loader must drop it on the way there) and refuses a URL whose
signature expired (`expire_signatures`). `push` makes a new commit and
moves `main` to it; `rewrite` serves other bytes at a commit, `corrupt_blob` other bytes for a
blob from storage. Test support only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler

from support.range_server import QuietHandler, Served, ServerThread, send_error, send_file_bytes

LFS_MIN_BYTES = 1024
"""Files of this size or more are stored with LFS (the Hub's rule is by type and size)."""


@functools.cache
def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@functools.cache
def lfs_sha256(data: bytes) -> str:
    """The LFS digest of `data`, computed once per file (the benchmark serves large files: a
    digest per request would bound what the stand-in serves)."""
    return hashlib.sha256(data).hexdigest()


class HubServer:
    """One repository `repo_id` whose `main` holds `files` (see the module docstring)."""

    def __init__(self, repo_id: str, files: dict[str, bytes], *, token: str | None = None
                 ) -> None:
        self.repo_id, self.token = repo_id, token
        self.commits: dict[str, dict[str, bytes]] = {}
        self.branches: dict[str, str] = {}
        self.blobs: dict[str, bytes] = {}
        self.served, self.stored = Served(), Served()
        self.signature = 0
        """The generation of the storage URLs' signatures; older ones are refused (403)."""
        self.leaked_authorization = 0
        """Requests that reached the storage host with an `Authorization` header."""
        self._lock = threading.Lock()
        self._cdn = ServerThread(self._cdn_handler())
        self.cdn_url = self._cdn.url
        """Where LFS files redirect to (a test may put a proxy in front of `_cdn`)."""
        self._api = ServerThread(self._api_handler())
        self.push(files)

    @property
    def url(self) -> str:
        return self._api.url

    @property
    def storage_url(self) -> str:
        """The storage host itself (behind any proxy a test puts in `cdn_url`)."""
        return self._cdn.url

    def __enter__(self) -> HubServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._api.close()
        self._cdn.close()

    def push(self, files: dict[str, bytes]) -> str:
        """A new commit holding `files`; `main` moves to it. Returns its hash."""
        with self._lock:
            commit = hashlib.sha1(f"{len(self.commits)}:{sorted(files)}".encode()).hexdigest()
            self.commits[commit] = dict(files)
            self.branches["main"] = commit
            for data in files.values():
                self.blobs[lfs_sha256(data)] = data
            return commit

    def expire_signatures(self) -> None:
        """Storage refuses every storage URL handed out so far (their signatures expired)."""
        self.signature += 1

    def rewrite(self, commit: str, name: str, data: bytes) -> None:
        """Serve other bytes for `name` at `commit` (a mirror gone wrong: a commit's files never
        change on the Hub)."""
        with self._lock:
            self.commits[commit] = {**self.commits[commit], name: data}
            self.blobs[lfs_sha256(data)] = data

    def corrupt_blob(self, data: bytes) -> None:
        """Storage serves the blob of `data` with one byte flipped (a broken mirror)."""
        sha = lfs_sha256(data)
        broken = bytearray(data)
        broken[len(broken) // 2] ^= 0xFF
        self.blobs[sha] = bytes(broken)

    def _commit(self, revision: str) -> str | None:
        revision = urllib.parse.unquote(revision)
        return revision if revision in self.commits else self.branches.get(revision)

    def _info(self, commit: str, blobs: bool) -> dict:
        siblings = []
        for name, data in sorted(self.commits[commit].items()):
            sibling: dict = {"rfilename": name}
            if blobs:
                sibling |= {"size": len(data), "blobId": blob_id(data)}
                if len(data) >= LFS_MIN_BYTES:
                    sibling["lfs"] = {"size": len(data), "pointerSize": 134,
                                      "sha256": lfs_sha256(data)}
            siblings.append(sibling)
        return {"_id": "0" * 24, "id": self.repo_id, "modelId": self.repo_id, "sha": commit,
                "private": False, "disabled": False, "gated": False, "downloads": 0,
                "likes": 0, "tags": [], "siblings": siblings,
                "lastModified": "2026-01-01T00:00:00.000Z",
                "createdAt": "2026-01-01T00:00:00.000Z"}

    def _api_handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    hub.served.count(self.command)
                    send_error(self, 401, "RepoNotFound")  # the Hub hides what it denies
                    return
                parts = urllib.parse.urlsplit(self.path)
                api = f"/api/models/{hub.repo_id}/revision/"
                resolve = f"/{hub.repo_id}/resolve/"
                if parts.path.startswith(api) or parts.path == api.removesuffix("/revision/"):
                    self._info(parts.path[len(api):] or "main", "blobs=true" in parts.query)
                elif parts.path.startswith(resolve):
                    revision, _, name = parts.path[len(resolve):].partition("/")
                    self._resolve(revision, urllib.parse.unquote(name))
                else:
                    hub.served.count(self.command)
                    send_error(self, 404, "RepoNotFound")

            do_HEAD = do_GET

            def _info(self, revision: str, blobs: bool) -> None:
                commit = hub._commit(revision)
                if commit is None:
                    hub.served.count(self.command)
                    send_error(self, 404, "RevisionNotFound")
                    return
                payload = json.dumps(hub._info(commit, blobs)).encode()
                hub.served.count(self.command)  # before the answer: its client sees it counted
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _resolve(self, revision: str, name: str) -> None:
                commit = hub._commit(revision)
                data = hub.commits.get(commit or "", {}).get(name)
                if data is None:
                    hub.served.count(self.command)
                    send_error(self, 404, "EntryNotFound")
                    return
                headers = {"X-Repo-Commit": commit or ""}
                if len(data) < LFS_MIN_BYTES:
                    send_file_bytes(self, data, f'"{blob_id(data)}"', hub.served, headers)
                    return
                sha = lfs_sha256(data)
                hub.served.count(self.command)
                self.send_response(302)
                for key, value in {**headers, "X-Linked-Etag": f'"{sha}"',
                                   "X-Linked-Size": str(len(data)), "ETag": f'"{blob_id(data)}"',
                                   "Location": f"{hub.cdn_url}/blobs/{sha}?X-Signature="
                                               f"s3cr3t-{hub.signature}",
                                   "Content-Length": "0"}.items():
                    self.send_header(key, value)
                self.end_headers()

        return Handler

    def _cdn_handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
                if "Authorization" in self.headers:
                    hub.leaked_authorization += 1
                parts = urllib.parse.urlsplit(self.path)
                if parts.query != f"X-Signature=s3cr3t-{hub.signature}":
                    hub.stored.count(self.command)
                    send_error(self, 403, "AccessDenied")
                    return
                sha = parts.path.rpartition("/")[2]
                data = hub.blobs.get(sha)
                if data is None:
                    hub.stored.count(self.command)
                    send_error(self, 404, "NoSuchKey")
                    return
                send_file_bytes(self, data, f'"{sha}"', hub.stored)

            do_HEAD = do_GET

        return Handler
