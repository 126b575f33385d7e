"""Attention over the KV pool: one backend per kernel family behind ``prepare`` / ``forward``
(``flash``: padded PyTorch flash attention; ``decode``: the fused decode kernel; ``ragged``: the AMX
ragged kernel) and ``CompositeAttention``, which writes the pool, finds shared segments and splits a
batch between them. ``TorchNativeAttention`` is the reference (padded flash and PyTorch ops alone).
See ``composite`` for the batch decomposition and routing."""

from idleless.model.attention.base import AttentionBackend, AttnWork, BackendPlan, Tails
from idleless.model.attention.composite import (
    MIN_SHARED_TOKENS,
    AttnMetadata,
    CompositeAttention,
    TorchNativeAttention,
    find_shared_segments,
)
from idleless.model.attention.decode import DecodeGroup, FusedDecodeAttention
from idleless.model.attention.flash import PaddedFlashAttention, SegmentGroup, TailGroup
from idleless.model.attention.ragged import PACK_CACHE_BYTES, PackedKeys, RaggedAmxAttention, RaggedGroup

__all__ = [
    "AttentionBackend", "AttnMetadata", "AttnWork", "BackendPlan", "CompositeAttention", "DecodeGroup",
    "FusedDecodeAttention", "MIN_SHARED_TOKENS", "PACK_CACHE_BYTES", "PackedKeys", "PaddedFlashAttention",
    "RaggedAmxAttention", "RaggedGroup", "SegmentGroup", "TailGroup", "Tails", "TorchNativeAttention",
    "find_shared_segments",
]
