"""How a large remote batch is cut into waves, so its control round trips overlap its
data.

Sent as one ``Reserve`` (or ``Lookup``), a batch moves no byte until the node has
answered for every key, and a put's ``Commit`` leaves only when the last byte landed: on
two hosts over TCP that was ~10% of a 32 x 512 KiB batch (the node's per-key work and a
round trip, twice for a put). Cut into waves, every wave's request still leaves before
any answer is read, but the first wave's transfer starts as soon as its own answer
comes, while the node is still answering the others; each wave's ``Commit`` leaves when
its own transfer ends, while the next waves' bytes still flow. What stays exposed is the
first wave's answer and the last wave's commit, so both are the small ones (1/8 of the
bytes each, the three middle waves 1/4).

Each key is in exactly one wave and each wave is asked exactly as a whole batch was
(same messages, same codes), so what a caller sees does not change.
"""

from __future__ import annotations

__all__ = ["WAVE_MIN_BYTES", "waves"]

#: batches smaller than this stay one request: a wave's message costs more than it hides
WAVE_MIN_BYTES = 4 << 20
#: where the waves end, as fractions of the batch's bytes
_CUTS = (1 / 8, 3 / 8, 5 / 8, 7 / 8)


def waves(idx: list[int], nbytes: list[int]) -> list[list[int]]:
    """``idx`` (keys in batch order) cut into consecutive waves by the bytes ``nbytes[i]``
    of each key ``i``: one wave when the batch is small, else up to five, the first and
    the last the smallest. Every wave holds at least one key; together they are ``idx``
    in order."""
    total = sum(nbytes[i] for i in idx)
    if total < WAVE_MIN_BYTES or len(idx) < 2:
        return [list(idx)] if idx else []
    out: list[list[int]] = []
    cur: list[int] = []
    done = 0
    cut = 0
    for i in idx:
        cur.append(i)
        done += nbytes[i]
        if cut < len(_CUTS) and done >= _CUTS[cut] * total:
            out.append(cur)
            cur = []
            while cut < len(_CUTS) and done >= _CUTS[cut] * total:
                cut += 1
    if cur:
        out.append(cur)
    return out
