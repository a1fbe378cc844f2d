"""Which byte ranges a remote put or get moves: the caller's pieces against the object's
chunk slots, as few transfer requests as the layout allows.

A chunk ``c`` of an object lives at ``offsets[c]`` in the node's region. Where the slots
of consecutive chunks follow each other in that region (the usual case: the node hands a
new object's slots out in ascending order, segment.py) and the caller's piece runs on,
the chunks become one request: fewer frames, acknowledgements and wake-ups for the
transfer engine than one request per chunk.
"""

from __future__ import annotations

__all__ = ["plan_spans"]


def plan_spans(sizes: list[int], total: int, chunk: int, offsets: list[int]) -> list[tuple[int, int, int, int]]:
    """``(piece, offset in the piece, offset in the remote region, length)`` covering the
    first ``total`` bytes of the pieces (of ``sizes`` bytes each) in order, against chunk
    ``c`` of the object at ``offsets[c]``; adjacent ranges that continue each other on
    both sides are merged."""
    out: list[tuple[int, int, int, int]] = []
    pos = 0
    for p, n in enumerate(sizes):
        n = min(n, total - pos)
        if n <= 0:
            break
        s, e = pos, pos + n
        while s < e:
            c, within = divmod(s, chunk)
            take = min(e - s, chunk - within)
            remote = offsets[c] + within
            if out:
                lp, lo, lr, ln = out[-1]
                if lp == p and lo + ln == s - pos and lr + ln == remote:
                    out[-1] = (lp, lo, lr, ln + take)
                    s += take
                    continue
            out.append((p, s - pos, remote, take))
            s += take
        pos += n
    return out
