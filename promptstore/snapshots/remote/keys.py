"""Remote keys: what a prefix is called on the shared server, revealing nothing.

Every key is a BLAKE2b hash keyed by a secret derived from the namespace
fingerprint (which hashes the model, the cache layout and the tenant salt) and
the deployment's `remote_secret`. Tokens are hashed in fixed chunks, chained, so
a prompt of n tokens has n // CHUNK grid keys a lookup asks for in one round
trip; positions between grid points hash the chunk's head from the last grid key.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import numpy as np

CHUNK = 256  # tokens per chunk of the remote index (every replica must agree: it is part of the keys)
DIGEST = 16
_PERSON = b"promptstore.rt1"  # the key schedule's version: a change makes old keys unreachable, never wrong
INDEX_PREFIX = "ps:i:"
BLOB_PREFIX = "ps:b:"


@dataclass(frozen=True)
class RemoteKeys:
    """The secrets of one namespace on the remote tier."""

    index: bytes  # keys the token hashes
    seal: bytes  # AES-256-GCM key of records and blobs

    @classmethod
    def of(cls, namespace: bytes, secret: str | None = None) -> RemoteKeys:
        root = hashlib.blake2b(
            namespace + CHUNK.to_bytes(4, "little"), key=(secret or "").encode()[:64], person=_PERSON
        ).digest()
        return cls(_derive(root, b"index"), _derive(root, b"seal"))

    def _hasher(self, tag: bytes):
        h = hashlib.blake2b(key=self.index, digest_size=DIGEST, person=_PERSON)
        h.update(tag)
        return h

    def grid(self, tokens: np.ndarray, upto: int) -> list[bytes]:
        """Chained chunk hashes h_0..h_m of tokens[:m * CHUNK], m = upto // CHUNK;
        h_j names the prefix tokens[:j * CHUNK]."""
        data = _packed(tokens)
        chain = [self._hasher(b"root").digest()]
        for j in range(upto // CHUNK):
            h = self._hasher(b"chunk")
            h.update(chain[-1])
            h.update(data[j * CHUNK * 4 : (j + 1) * CHUNK * 4])
            chain.append(h.digest())
        return chain

    def positions(self, grid: list[bytes], tokens: np.ndarray, lo: int, hi: int) -> dict[int, bytes]:
        """The key of every prefix tokens[:p], lo <= p <= hi, all within one chunk
        after a grid point that `grid` reaches."""
        out: dict[int, bytes] = {}
        if hi < lo:
            return out
        j = lo // CHUNK
        base = j * CHUNK
        if hi > base + CHUNK:
            raise ValueError(f"positions [{lo}, {hi}] span more than the chunk after {base}")
        data = _packed(tokens)
        h = self._hasher(b"tail")
        h.update(grid[j])
        h.update(data[base * 4 : lo * 4])
        for p in range(lo, hi + 1):
            if p > lo:
                h.update(data[(p - 1) * 4 : p * 4])
            out[p] = grid[p // CHUNK] if p % CHUNK == 0 else h.copy().digest()
        return out

    def position(self, tokens: np.ndarray, p: int, grid: list[bytes] | None = None) -> bytes:
        """The key of the prefix tokens[:p]."""
        grid = grid if grid is not None and len(grid) > p // CHUNK else self.grid(tokens, p)
        if p % CHUNK == 0:
            return grid[p // CHUNK]
        return self.positions(grid, tokens, p, p)[p]

    def blob(self, end_key: bytes, start: int) -> bytes:
        """The id of a node's blob: its whole prefix (through the key of its end) and its start."""
        h = self._hasher(b"blob")
        h.update(end_key)
        h.update(start.to_bytes(8, "little"))
        return h.digest()

    def piece(self, blob_id: bytes, index: int) -> bytes:
        """The id of piece `index` (>= 1) of a blob in pieces; piece 0 is at the blob's own id."""
        h = self._hasher(b"piece")
        h.update(blob_id)
        h.update(index.to_bytes(4, "little"))
        return h.digest()

    def pieces(self, blob_id: bytes, count: int) -> list[str]:
        """The keys of a blob's `count` values: its own key, then one per further piece."""
        return [blob_key(blob_id)] + [blob_key(self.piece(blob_id, i)) for i in range(1, count)]


def index_key(position_key: bytes) -> str:
    return INDEX_PREFIX + position_key.hex()


def blob_key(blob_id: bytes) -> str:
    return BLOB_PREFIX + blob_id.hex()


def _derive(root: bytes, label: bytes) -> bytes:
    return hmac.digest(root, label, "sha256")


def _packed(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()
