"""Every error promptstore raises, in one place.

Each error says what was wrong and what was expected. Anything that raises one
of these has left the caller's caches and the store as they were.
"""


class PromptStoreError(Exception):
    """Base of every promptstore error."""


# --- caches and snapshots ---------------------------------------------------


class CacheError(PromptStoreError):
    """A cache or snapshot operation was given input it cannot use."""


class CacheShapeError(CacheError):
    """Arrays of the wrong rank, head count, head dim, batch or dtype."""


class SnapshotKindError(CacheError):
    """A snapshot of another kind or layout than the cache it is applied to."""


class SnapshotRangeError(CacheError):
    """Offsets that are negative, out of order, or outside a snapshot's span."""


class SnapshotFormatError(CacheError):
    """A serialized snapshot whose metadata or arrays are malformed."""


class UnknownKindError(SnapshotFormatError):
    """A serialized kind name that is not in the closed registry."""


class UnsupportedCacheError(CacheError):
    """A cache object promptstore does not know how to adopt or snapshot."""


# --- tiers ------------------------------------------------------------------


class TierError(PromptStoreError):
    """A snapshot tier could not store or serve a node."""


class ColdFileError(TierError):
    """A cold snapshot file that cannot be served: missing, corrupt, or another node's.

    reason: a short tag for reports ("missing", "header", "checksum", "identity", ...).
    """

    def __init__(self, message: str, reason: str = "corrupt", path: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.path = path


class DiskWriteError(TierError):
    """A cold file could not be written (disk full, read-only filesystem, ...)."""


class RemoteError(TierError):
    """The remote tier could not serve or store something: down, slow, full, or
    answering bytes that fail their checks. Callers of the store never see it: it
    becomes a reported miss.

    reason: a short tag for reports ("down", "garbage", "missing", ...).
    """

    def __init__(self, message: str, reason: str = "down"):
        super().__init__(message)
        self.reason = reason


# --- index ------------------------------------------------------------------


class IndexStoreError(PromptStoreError):
    """The LMDB index refused an operation."""


class InvalidTokensError(IndexStoreError, ValueError):
    """Tokens that are not a non-empty sequence of 32-bit non-negative ints."""


class TokenRangeError(InvalidTokensError):
    """A token id at or past the model's vocabulary size (the embedding would read out of bounds)."""


class IndexCorruptError(IndexStoreError):
    """The index's data file is damaged (shorter than its header says, or empty in a used
    store): opening it would crash the process or serve an empty store, so it is refused."""


class SchemaVersionError(IndexStoreError):
    """The store was written by a schema this code cannot read."""


class CorruptRecordError(IndexStoreError):
    """An index record failed to decode or validate."""


class StaleInsertError(IndexStoreError):
    """The trie changed between plan_insert and commit_insert; plan again."""


class KeyCollisionError(IndexStoreError):
    """A new node's key is already taken by another prefix; the insert was refused."""


class NodeNotFoundError(IndexStoreError, KeyError):
    """No node with that key in that namespace."""


class NodeHasChildrenError(IndexStoreError):
    """Only leaves can be removed; the node still has children."""


class UnknownNamespaceError(IndexStoreError, KeyError):
    """A namespace that was never registered in this index."""


class RecordLayoutError(IndexStoreError, ValueError):
    """A node record whose layers do not match its namespace, or missing records."""


class ReadOnlyIndexError(IndexStoreError):
    """A write to an index opened read-only."""


class IndexDiskError(IndexStoreError):
    """The disk refused the index's write (full, read-only or failing): the
    transaction did not happen, and the index is as it was."""


class StoreDirectoryError(PromptStoreError):
    """The store directory is unsafe or unusable (a symlink, another owner's, not a directory)."""


class SettingsError(PromptStoreError, ValueError):
    """A setting (argument or PROMPTSTORE_* variable), or a namespace's model_id or
    salt, that is not a valid value."""


class ModelPathError(PromptStoreError, ValueError):
    """A model path that is not a local MLX model directory (nothing is ever downloaded)."""


class ServeConfigError(PromptStoreError, ValueError):
    """A `promptstore serve` option or API-keys file that cannot be used."""


class ServeRequestError(PromptStoreError, ValueError):
    """A request `promptstore serve` refuses; `status` is the HTTP status it answers
    with, `param` the request field at fault when one is (APIs that report it)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class GenerationFailed(PromptStoreError, RuntimeError):
    """A request of `promptstore serve` whose generation failed, or could not
    begin (generation stopped, the server shutting down): its client gets a 500,
    or a 503 while the server shuts down, in its API's shape."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class ModelIdentityError(SettingsError):
    """A model_id whose namespace was bound with other weights: its cache would be
    restored into a different model. `model_id` is the id at fault."""

    def __init__(self, message: str, model_id: str | None = None):
        super().__init__(message)
        self.model_id = model_id


class StoreNotWritableError(StoreDirectoryError):
    """The store directory cannot be written: on a read-only filesystem, or without
    write permission for this user (a store writes its lock, index and files there)."""


class ImageInputError(PromptStoreError, ValueError):
    """An image a prompt cannot take: not an image, too large, too many, a source
    refused (a remote URL, a file outside the folders allowed) or a format the
    model's processor refuses. `part` names the prompt part at fault
    (`messages[1].content[2]`), the server's 400 says it."""

    def __init__(self, message: str, part: str | None = None):
        super().__init__(f"{part}: {message}" if part else message)
        self.part = part
