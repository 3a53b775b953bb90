"""Namespaces: everything that makes a cache valid, reduced to a 16-byte fingerprint.

The fingerprint is the root key of a namespace's trie and seeds every node key in
it, so two namespaces never share a node. A tenant's salt enters it only as a
keyed, slow digest (tenant_digest): no spec, key or file holds the salt itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field, model_validator

LayerKind = Literal[
    "kv",
    "rotating",
    "quantized",
    "chunked",
    "arrays",
    "cache_list",
    "batch_kv",
    "batch_rotating",
]

# Kinds whose snapshots were, in the first format, the whole state at an offset. This
# is the layout's `whole_state`, part of every fingerprint and node record, so it
# keeps its meaning; how a layer restores is its role (below).
WHOLE_STATE_KINDS = frozenset({"rotating", "arrays", "batch_rotating"})

# How a layer of each kind restores, which the trie needs to know (without MLX):
# range layers anywhere their positions are stored on the whole path; state layers
# (recurrent) only at the end of a node that holds their state; window layers
# (sliding window, stored as ranges) wherever the last window's positions are
# stored, which the trie does not track: the store checks it when it restores.
STATE_KINDS = frozenset({"arrays", "batch_rotating"})
WINDOW_KINDS = frozenset({"rotating"})

# Bumped only if the canonical encoding changes; old fingerprints then stop matching.
_FINGERPRINT_VERSION = 1

# scrypt at its interactive cost (N=2**14, r=8: 16 MiB and tens of milliseconds per
# guess), keyed by a random key of each store, so that a reader of the index can only
# test guesses of a salt, one store at a time, at that cost each.
_SCRYPT = {"n": 2**14, "r": 8, "p": 1, "dklen": 16}


class LayerSpec(BaseModel):
    """The cache layout of one model layer (a cache list nests its caches in `children`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: LayerKind
    window: int | None = Field(default=None, ge=1, description="rotating: max_size")
    keep: int | None = Field(default=None, ge=0)
    bits: int | None = Field(default=None, ge=1)
    group_size: int | None = Field(default=None, ge=1)
    chunk_size: int | None = Field(default=None, ge=1)
    dtype: str | None = None
    children: list[LayerSpec] = Field(default_factory=list)
    whole_state: bool = False

    @model_validator(mode="before")
    @classmethod
    def _derive_whole_state(cls, data: Any) -> Any:
        # whole_state follows from the kind; a caller may state it, but never contradict it.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "max_size" in data and "window" not in data:
            data["window"] = data.pop("max_size")
        derived = _whole_state_of(data.get("kind"), data.get("children") or [])
        given = data.get("whole_state")
        if given is not None and given != derived:
            raise ValueError(f"whole_state={given} contradicts kind {data.get('kind')!r}")
        data["whole_state"] = derived
        return data

    @model_validator(mode="after")
    def _children_only_for_lists(self) -> LayerSpec:
        if (self.kind == "cache_list") != bool(self.children):
            raise ValueError("children are required for kind 'cache_list' and only there")
        return self


def _whole_state_of(kind: Any, children: list[Any]) -> bool:
    if kind != "cache_list":
        return kind in WHOLE_STATE_KINDS
    # A cache list restores only where every one of its caches can.
    return any(
        c.whole_state if isinstance(c, LayerSpec) else _whole_state_of(c.get("kind"), c.get("children") or [])
        for c in children
    )


@functools.lru_cache(maxsize=1024)  # a server binds each tenant again and again
def tenant_digest(salt: str, key: bytes) -> str:
    """The keyed, slow digest of a tenant's salt that a namespace holds (hex, 32 digits)."""
    return hashlib.scrypt(salt.encode(), salt=key, **_SCRYPT).hex()


def _role(layer: LayerSpec) -> str:
    if layer.kind in STATE_KINDS or any(_role(c) == "state" for c in layer.children):
        return "state"  # a cache list restores only where every one of its caches can
    return "window" if layer.kind in WINDOW_KINDS else "range"


class NamespaceSpec(BaseModel):
    """Model identity, per-layer cache layout and an optional tenant (a digest of its salt)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: str | None = None
    weights_digest: str | None = None
    layers: list[LayerSpec] = Field(min_length=1)
    tenant: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{32}$", description="tenant_digest of the salt, never the salt"
    )
    shard: str | None = Field(
        default=None,
        max_length=200,
        description="a distributed group's rank: the part of the model's cache it holds (store/group.py)",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_clear_salt(cls, data: Any) -> Any:
        # Schema 1 stored {"salt": null} in every unsalted spec, and the salt itself in salted ones.
        if isinstance(data, dict) and "salt" in data:
            if data["salt"] is not None:
                raise ValueError("the spec holds a tenant salt in clear (written by schema 1)")
            data = {k: v for k, v in data.items() if k != "salt"}
        return data

    @model_validator(mode="after")
    def _identity_required(self) -> NamespaceSpec:
        if self.model_id is None and self.weights_digest is None:
            raise ValueError("a namespace needs a model_id or a weights_digest")
        return self

    def canonical_json(self) -> bytes:
        """The encoding the fingerprint hashes: sorted keys, no whitespace."""
        # A namespace of no group leaves `shard` out: its fingerprint is the one it had before groups.
        spec = self.model_dump(mode="json", exclude={"tenant"} | self.unset())
        # The tenant sits where schema 1 put the salt, so that unsalted namespaces
        # (salt null then, tenant null now) keep their fingerprints and their nodes.
        spec["salt"] = self.tenant
        doc = {"v": _FINGERPRINT_VERSION, "spec": spec}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    def unset(self) -> set[str]:
        """Fields newer than the stored format that this spec leaves unset: left out of
        what is stored and hashed, so a spec without them reads and hashes as before."""
        return {"shard"} if self.shard is None else set()

    def fingerprint(self) -> bytes:
        """xxh3-128 of the canonical JSON, 16 bytes."""
        return xxhash.xxh3_128_digest(self.canonical_json())

    def fingerprint_hex(self) -> str:
        return self.fingerprint().hex()


@dataclass(frozen=True, eq=False)
class Namespace:
    """A registered namespace: its spec and its fingerprint (the trie's root key)."""

    spec: NamespaceSpec
    key: bytes

    @classmethod
    def of(cls, spec: NamespaceSpec) -> Namespace:
        return cls(spec=spec, key=spec.fingerprint())

    @property
    def hex(self) -> str:
        return self.key.hex()

    @property
    def n_layers(self) -> int:
        return len(self.spec.layers)

    @cached_property
    def whole(self) -> tuple[bool, ...]:
        """Per layer: True where the layer's snapshots are whole state at an offset."""
        return tuple(layer.whole_state for layer in self.spec.layers)

    @cached_property
    def whole_mask(self) -> int:
        return sum(1 << i for i, w in enumerate(self.whole) if w)

    @cached_property
    def roles(self) -> tuple[str, ...]:
        """Per layer: "range", "state" or "window" (see STATE_KINDS in this module)."""
        return tuple(_role(layer) for layer in self.spec.layers)

    @cached_property
    def range_mask(self) -> int:
        return self._mask("range")

    @cached_property
    def state_mask(self) -> int:
        return self._mask("state")

    @cached_property
    def window_mask(self) -> int:
        return self._mask("window")

    def _mask(self, role: str) -> int:
        return sum(1 << i for i, r in enumerate(self.roles) if r == role)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        name = self.spec.model_id or self.spec.weights_digest
        return f"Namespace({name!r}, {self.hex[:12]}…, {self.n_layers} layers)"
