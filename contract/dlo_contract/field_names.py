"""How a message names a settings field: the `Names` type and the document spelling.

Owns the shape of a field namer, a function from a document path (`cache.max_bytes`) to the name
a message shows. `dlo_contract.validation` resolves the namer a document's origin calls for
(`names_for`: the CR path when the operator rendered the document from a CR, else this module's
`document_names`); each plane resolves it once from its validated settings and hands it to the
code that writes messages. Standard library only, so that the cache package may take a namer
without importing the settings schema. Must not know any CR path.
"""

from __future__ import annotations

from collections.abc import Callable

Names = Callable[[str], str]
"""Turns a document path (`offload.use_allgather`) into the name a message shows."""


def document_names(path: str) -> str:
    """The document path itself: the spelling of a settings document written by hand."""
    return path
