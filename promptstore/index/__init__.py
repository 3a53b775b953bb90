"""The LMDB index: namespaces, the radix trie of token spans, access order, counters.

The only package that talks to LMDB; it imports no MLX.
"""

from .index import Index
from .keys import as_tokens, prefix_key
from .namespace import LayerSpec, Namespace, NamespaceSpec
from .records import FileNode, LayerRef, Node, NodeRecord
from .trie import InsertPlan, InsertResult, Match, SplitPlan

__all__ = [
    "Index",
    "InsertPlan",
    "FileNode",
    "InsertResult",
    "LayerRef",
    "LayerSpec",
    "Match",
    "Namespace",
    "NamespaceSpec",
    "Node",
    "NodeRecord",
    "SplitPlan",
    "as_tokens",
    "prefix_key",
]
