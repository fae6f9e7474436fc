"""Errors of the loader, split by what the caller (a person, or Kubernetes restarting the pod)
should do next.

Permanent errors (`LoaderError` and subclasses) need a change first: a bad source URI, a missing
or changed object, a malformed safetensors file, a broken peer. Transient ones
(`SourceUnavailable`, `RendezvousTimeout`) are worth another attempt later: the object store kept
throttling, or the other loaders did not show up in time. Every loader module raises these; the
CLI turns them into the one-line error summary. Must not import anything beyond the shared base.
"""

from __future__ import annotations

from dlo_contract.errors import PermanentError, TransientError


class LoaderError(PermanentError):
    """The fill cannot succeed as configured or with the data found."""


class SourceError(LoaderError):
    """The object store refused or lacks what the fill needs (denied, missing, changed)."""


class SourceChanged(SourceError):
    """An object is no longer the one listed (ETag, range or length differ): nothing publishes."""


class LocalResourceError(LoaderError):
    """This node ran out of something (descriptors, disk, memory): not the store's failure,
    never retried as one."""


class GroupError(LoaderError):
    """Another loader of the group failed or vanished; this one stops too, publishing nothing."""


class MemberLost(GroupError):
    """The heartbeat found another loader of the group dead, stopped or gone (see `peers`):
    the survivors may go on without it (`survive`)."""


class SourceUnavailable(TransientError):
    """The object store kept failing (throttling, 5xx, resets) past the retry budget."""


class RendezvousTimeout(TransientError):
    """Not every loader joined the group in time, and the fallback policy is `fail`."""
