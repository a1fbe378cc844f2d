"""Pool metrics: keys, bytes per tier, hits and misses per tier (object reads that found
the key but could not read it apart from keys that were not there), evictions, replicas
lost; in Prometheus text form for a node's ``/metrics``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["PoolMetrics", "segment_metrics", "prometheus_text"]


@dataclass
class PoolMetrics:
    nodes: int = 0
    keys: int = 0
    object_bytes: int = 0
    bytes_dram: int = 0
    bytes_ssd: int = 0
    capacity_dram: int = 0
    capacity_ssd: int = 0
    #: chunk reads served from each tier (the Rust store's own counters)
    hits_dram: int = 0
    hits_ssd: int = 0
    #: object reads: found and read / not in the pool / in the table but a chunk was gone
    object_hits: int = 0
    object_misses: int = 0
    object_failed_reads: int = 0
    puts: int = 0
    puts_existing: int = 0
    puts_no_space: int = 0
    #: objects of remote puts published as their last byte landed over TCP, without a Commit
    puts_landed: int = 0
    #: objects of remote puts written into spare slots the client held (no Reserve round trip)
    puts_into_spares: int = 0
    #: chunk evictions per tier, and whole objects dropped because a chunk was evicted
    evictions_dram: int = 0
    evictions_ssd: int = 0
    objects_evicted: int = 0
    removes: int = 0
    #: objects a durable node found again on disk when it started / dropped there (damaged)
    objects_recovered: int = 0
    objects_recovery_dropped: int = 0
    #: reads that found a replica's node dead or unreachable (client side)
    replicas_lost: int = 0
    #: puts that placed fewer replicas than asked for (client side)
    under_replicated: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __add__(self, other: "PoolMetrics") -> "PoolMetrics":
        return PoolMetrics(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def segment_metrics(segment, nodes: int = 1) -> PoolMetrics:  # noqa: ANN001 - ObjectSegment
    m = PoolMetrics(nodes=nodes, keys=len(segment), object_bytes=segment.object_bytes())
    for sc in segment.classes:
        st = sc.store.stats()
        m.bytes_dram += st.bytes_dram
        m.bytes_ssd += st.bytes_ssd
        m.capacity_dram += st.slots_dram * sc.chunk_bytes
        m.capacity_ssd += st.slots_ssd * sc.chunk_bytes
        m.hits_dram += st.hits_dram
        m.hits_ssd += st.hits_ssd
        m.evictions_dram += st.evictions_dram
        m.evictions_ssd += st.evictions_ssd
    c = segment.counters
    m.object_hits, m.object_misses, m.object_failed_reads = c.hits, c.misses, c.failed_reads
    m.puts, m.puts_existing, m.puts_no_space, m.puts_landed = c.puts, c.puts_existing, c.puts_no_space, c.puts_landed
    m.puts_into_spares = c.puts_into_spares
    m.objects_evicted, m.removes = c.objects_evicted, c.removes
    m.objects_recovered, m.objects_recovery_dropped = c.recovered, c.recovery_dropped
    return m


_HELP = {
    "keys": "objects held", "object_bytes": "bytes of the objects held",
    "bytes_dram": "bytes of DRAM slots in use", "bytes_ssd": "bytes of SSD slots in use",
    "hits_dram": "chunk reads served from DRAM", "hits_ssd": "chunk reads served from SSD",
    "object_misses": "reads of keys not in the pool",
    "object_failed_reads": "reads of keys present in the table whose bytes could not be read",
    "replicas_lost": "reads that found a replica's node gone",
    "puts_landed": "objects of remote puts published as their last byte landed over TCP (no Commit round trip)",
    "puts_into_spares": "objects of remote puts written into spare slots the client held (no Reserve round trip)",
    "objects_recovery_dropped": "objects found damaged or incomplete on disk at start, dropped",
}


def prometheus_text(m: PoolMetrics, labels: dict[str, str] | None = None) -> str:
    lab = ""
    if labels:
        lab = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    out = []
    for f in fields(m):
        name = f"mooncake_pool_{f.name}"
        if f.name in _HELP:
            out.append(f"# HELP {name} {_HELP[f.name]}")
        out.append(f"{name}{lab} {getattr(m, f.name)}")
    return "\n".join(out) + "\n"
