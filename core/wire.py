r"""What a message's content costs on Flower's wire, counted without serialising it twice.

Flower sends a message as content-addressed objects (``flwr.supercore.inflatable``):
every record, array and array chunk is deflated to ``b"<type> <child ids> <body
length>\x00" + body``, named by the SHA-256 of those bytes, and an object that
appears twice in the tree (a record under two names, two equal arrays, equal
chunks) is sent once. Asking Flower for the total deflates every object and hashes
it, then deflates it again: about 0.2 ms per update, on the aggregator's one
thread, for every reply.

:func:`wire_bytes` gets the same number from each object's body alone: an id is
always 64 hex characters, so a header's length needs only the number of distinct
children, and "the same object" is decided by comparing contents (a chunk's bytes,
a record's items), not by hashing them. ``tests/core/test_wire.py`` holds it to
Flower's own count on generated contents.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

from flwr.app import Array, ArrayRecord, RecordDict
from flwr.app.message import array as flower_array

__all__ = ["wire_bytes", "content_bytes"]

#: Length of an object id (a SHA-256 in hex) in a header or a record's body.
_ID = 64


def wire_bytes(content: RecordDict) -> int:
    """Bytes Flower's wire spends on ``content``: every distinct object of its tree, deflated.

    Never raises: a content Flower cannot serialise (an integer beyond 64 bits,
    which only an in-process client can hand over) is counted by its arrays' bytes
    (:func:`content_bytes`).
    """
    try:
        sizes: dict[Hashable, int] = {}
        _count(content, sizes)
        return sum(sizes.values())
    except (ValueError, TypeError, OverflowError, AttributeError):
        return content_bytes(content) if isinstance(content, RecordDict) else 0


def content_bytes(content: RecordDict) -> int:
    """Approximate the wire size of a message's arrays (their serialised bytes).

    A record sent under two names (the legacy aliases) counts once, as Flower's
    wire sends it once.
    """
    records = {id(r): r for r in content.array_records.values()}
    return sum(len(a.data) for record in records.values() for a in record.values())


def _header(kind: str, children: int, body: int) -> int:
    r"""``len(f"{kind} {','.join(ids)} {body}") + 1`` (the ``\x00`` divider) for ``children`` distinct ids."""
    return len(kind.encode("utf-8")) + 1 + children * (_ID + 1) - (1 if children else 0) + 1 + len(str(body)) + 1


def _count(obj: Any, sizes: dict[Hashable, int]) -> Hashable:
    """Add ``obj`` and its descendants to ``sizes`` (key: the object's content); return its key."""
    kind = type(obj).__qualname__
    if isinstance(obj, (RecordDict, ArrayRecord)):
        children = [(name, _count(child, sizes)) for name, child in obj.items()]
        body = len(json.dumps({name: "0" * _ID for name, _ in children}).encode("utf-8"))
        key: Hashable = (kind, tuple(children))
        sizes.setdefault(key, _header(kind, len({k for _, k in children}), body) + body)
        return key
    if isinstance(obj, Array):
        return _count_array(obj, sizes)
    deflated = obj.deflate()  # a leaf record (metrics, config): its protobuf body, no children
    key = (kind, deflated)
    sizes.setdefault(key, len(deflated))
    return key


def _count_array(array: Array, sizes: dict[Hashable, int]) -> Hashable:
    # as Flower slices it: by item of the data's own memoryview (a chunk's header counts items, its body bytes)
    # Read where Array.deflate reads it (a patch there applies here), though that module does not re-export it
    step: int = flower_array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE  # type: ignore[attr-defined]  # not re-exported
    data = memoryview(array.data)
    chunks = [(len(piece), piece.tobytes()) for piece in (data[i:i + step] for i in range(0, len(data), step))]
    unique = {chunk: i for i, chunk in enumerate(dict.fromkeys(chunks))}  # equal chunks are one object
    for items, raw in unique:
        sizes.setdefault(("ArrayChunk", items, raw), _header("ArrayChunk", 0, items) + len(raw))
    body = len(json.dumps({"dtype": array.dtype, "shape": array.shape, "stype": array.stype,
                           "arraychunk_ids": [unique[c] for c in chunks]}).encode("utf-8"))
    kind = type(array).__qualname__
    key = (kind, array.dtype, tuple(array.shape), array.stype, tuple(chunks))
    sizes.setdefault(key, _header(kind, len(unique), body) + body)
    return key
