"""What the scheduler-side connector tells the workers each step (plain dataclasses: vLLM
serializes them to the worker processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["LoadSpec", "SaveSpec", "MooncakeRsConnectorMetadata"]


@dataclass
class LoadSpec:
    """Copy pool blocks (leased by the scheduler) into these vLLM blocks before the forward."""

    req_id: str
    pool: str  # the pool's control address
    block_ids: list[int]
    offsets: list[int]  # the blocks' slot offsets in that pool's arena
    checksums: list[int]  # CRC-32 of each block as saved (-1: unknown, not checked)
    keys: bytes  # 16-byte keys, for reporting corrupt blocks back to the pool


@dataclass
class SaveSpec:
    """Copy these vLLM blocks, once the forward wrote them, into the local pool."""

    req_id: str
    block_ids: list[int]
    keys: bytes


@dataclass
class MooncakeRsConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
