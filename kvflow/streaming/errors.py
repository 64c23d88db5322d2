"""The exceptions the streaming library raises: bad chunks (never written) and unreachable peers."""

from __future__ import annotations


class StreamingError(RuntimeError):
    """Base class of every error raised by `kvflow.streaming`."""


class ChunkError(StreamingError):
    """A chunk was rejected before any of its bytes reached a KV cache."""


class ChunkCorrupted(ChunkError):
    """The payload's checksum does not match the header (or the header itself is unreadable)."""


class ChunkTruncated(ChunkError):
    """The payload is shorter than the header says."""


class ChunkOversized(ChunkError):
    """The payload is longer than the header says, or larger than the receiver accepts."""


class ChunkOutOfOrder(ChunkError):
    """A chunk's sequence number skips ahead of the next one expected from its stream."""


class DuplicateChunk(ChunkError):
    """A chunk (or part of a region) that was already received arrived again."""


class ChunkMismatch(ChunkError):
    """A valid chunk that does not fit the destination (layers, heads, dtype, or request not expected)."""


class PeerError(StreamingError):
    """The other end of a transfer is gone or stopped answering."""


class PeerGone(PeerError):
    """The peer disconnected (or was never reachable)."""


class PeerTimeout(PeerError):
    """The peer did not acknowledge within the transfer timeout."""


class PeerRejected(PeerError):
    """The peer received a chunk but rejected it; the message carries its reason."""


def peer_gone(e: BaseException) -> bool:
    """Whether `e` is, or was raised because of, a peer that disconnected (the chain of causes)."""
    while e is not None:
        if isinstance(e, PeerGone):
            return True
        e = e.__cause__
    return False
