"""The order torch's CPU kernels leave equal elements in, for sort (unstable), topk and kthvalue.

torch documents that order as unspecified, but on CPU it is fixed by the algorithm: ``sort`` runs
libstdc++'s ``std::sort`` (introsort: median-of-three Hoare partitions down to segments of 16, then
one insertion sort), ``topk`` ``std::nth_element`` then ``std::sort`` of the first k-1 (or
``std::partial_sort`` when k * 64 <= n), ``kthvalue`` ATen's own median-of-three quickselect. This
module replays those partitions step for step, but each partition as whole-array operations: the
i-th element a Hoare scan stops at from the left is swapped with the i-th it stops at from the right,
as long as they have not crossed. So one partition of every segment of a row is a few cumulative sums
and scatters, and a sort is O(log n) of them. An insertion sort is stable, so it is a stable sort.

Elements are compared through integer ranks (equal elements, and all NaNs, share a rank), so the
comparisons are exact whatever the dtype. ``partial_sort`` (topk with k * 64 <= n) is a heap: it is
replayed element by element. Not replayed: the heap fallbacks of a partition deeper than 2*log2(n)
(an adversarial input); there equal elements keep the order of a stable sort.

Example::

    perm = sort_order(keys)               # keys: (rows, n) int ranks; perm: positions in sorted order
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

INT = jnp.int32


def _floor_log2(n: int) -> int:
    return max(int(n).bit_length() - 1, 0)


def _stable_in_segments(k, perm, seg):
    """Stable sort of (k, perm) by k within each run of equal ``seg`` (seg nondecreasing)."""
    _, k, perm = lax.sort((seg, k, perm), num_keys=2, is_stable=True)
    return k, perm


def _segment_total(flag, s, e):
    """Per element: how many ``flag`` elements its segment [s, e) holds."""
    c = jnp.concatenate([jnp.zeros((1,), INT), jnp.cumsum(flag.astype(INT))])
    return c[e] - c[s]


def _stoppers(k, s, e, left_region, right_region, pivot, left_default, right_default):
    """Slot arrays of a Hoare partition of every segment [s, e): ``lpos[s + m]`` is the m-th position
    (from the left) where the left scan stops (k >= pivot), ``rpos[s + m]`` the m-th (from the right)
    where the right scan stops (k <= pivot); empty slots hold the defaults (sentinels)."""
    n = k.shape[0]
    pos = jnp.arange(n, dtype=INT)
    is_l = left_region & (k >= pivot)
    is_r = right_region & (k <= pivot)
    cl = jnp.concatenate([jnp.zeros((1,), INT), jnp.cumsum(is_l.astype(INT))])  # cl[j]: stops before j
    rank_l = cl[pos] - cl[s]
    suffix = jnp.concatenate([jnp.cumsum(is_r[::-1].astype(INT))[::-1], jnp.zeros((1,), INT)])  # at/after j
    rank_r = suffix[pos + 1] - suffix[e]
    lpos = left_default.at[jnp.where(is_l, s + rank_l, n)].set(pos, mode="drop")
    rpos = right_default.at[jnp.where(is_r, s + rank_r, n)].set(pos, mode="drop")
    return lpos, rpos


def _swap_pairs(k, perm, lpos, rpos, valid):
    """Swap k/perm at lpos[q] <-> rpos[q] for every slot q where ``valid``."""
    n = k.shape[0]
    src = jnp.arange(n, dtype=INT)
    src = src.at[jnp.where(valid, lpos, n)].set(rpos, mode="drop")
    src = src.at[jnp.where(valid, rpos, n)].set(lpos, mode="drop")
    return k[src], perm[src]


def _libstdcxx_partition(k, perm, s, e, active):
    """One ``__unguarded_partition_pivot`` of every active segment [s, e): median of (s+1, mid, e-1)
    moved to s, then Hoare's partition around it. Returns (k, perm, cut) with cut per element."""
    n = k.shape[0]
    pos = jnp.arange(n, dtype=INT)
    a, b, c = s + 1, s + (e - s) // 2, e - 1
    a_, b_, c_ = (k[jnp.clip(v, 0, n - 1)] for v in (a, b, c))
    t = jnp.where(
        a_ < b_, jnp.where(b_ < c_, b, jnp.where(a_ < c_, c, a)), jnp.where(a_ < c_, a, jnp.where(b_ < c_, c, b))
    )
    first = active & (pos == s)
    k, perm = _swap_pairs(k, perm, pos, t, first)  # slot q = s of each active segment: swap s <-> t
    pivot = k[jnp.clip(s, 0, n - 1)]
    region = active & (pos > s) & (pos < e)
    lpos, rpos = _stoppers(k, s, e, region, region, pivot, e, s)
    valid = active & (lpos < rpos)
    m = _segment_total(valid, s, e)
    lm = lpos[jnp.clip(s + m, 0, n - 1)]
    cut = jnp.where(m == 0, lm, jnp.minimum(lm, rpos[jnp.clip(s + m - 1, 0, n - 1)]))
    k, perm = _swap_pairs(k, perm, lpos, rpos, valid)
    return k, perm, cut


def _introsort(k, perm, s, e, threshold, depth):
    """libstdc++'s introsort loop on the segments [s, e) (per element; a segment no longer than
    ``threshold`` is left alone), then its final insertion sort (a stable sort within [s0, e0))."""

    def body(state):
        k, perm, s, e, level = state
        active = (e - s > threshold) & (level < depth)
        k, perm, cut = _libstdcxx_partition(k, perm, s, e, active)
        pos = jnp.arange(k.shape[0], dtype=INT)
        left = pos < cut
        s = jnp.where(active & ~left, cut, s)
        e = jnp.where(active & left, cut, e)
        return k, perm, s, e, level + 1

    def more(state):
        _, _, s, e, level = state
        return jnp.any(e - s > threshold) & (level < depth)

    k, perm, _, _, _ = lax.while_loop(more, body, (k, perm, s, e, jnp.asarray(0, INT)))
    return k, perm


def sort_order(keys):
    """Rows of int ranks (rows, n) -> the original positions in the order torch's CPU ``sort``
    (stable=False, ascending ranks) leaves them."""
    rows, n = keys.shape
    perm = jnp.broadcast_to(jnp.arange(n, dtype=INT), (rows, n))
    if n <= 16:  # std::sort is one insertion sort: stable
        return lax.sort((keys, perm), num_keys=1, is_stable=True)[1]

    def row(k, p):
        s, e = jnp.zeros((n,), INT), jnp.full((n,), n, INT)
        k, p = _introsort(k, p, s, e, 16, 2 * _floor_log2(n))
        return lax.sort((k, p), num_keys=1, is_stable=True)[1]

    return jax.vmap(row)(keys.astype(INT), perm)


def _adjust_heap(hk, hp, hole, length, vk, vp):
    """libstdc++'s ``__adjust_heap`` (max-heap of ranks): move the hole at ``hole`` down to a leaf along
    the larger children, then push (vk, vp) up from there."""
    top = hole

    def down_more(st):
        _, _, hole, child = st
        return child < (length - 1) // 2

    def down(st):
        hk, hp, hole, child = st
        child = 2 * (child + 1)
        child = jnp.where(hk[child] < hk[child - 1], child - 1, child)
        return hk.at[hole].set(hk[child]), hp.at[hole].set(hp[child]), child, child

    hk, hp, hole, child = lax.while_loop(down_more, down, (hk, hp, hole, hole))
    last = ((length & 1) == 0) & (child == (length - 2) // 2)
    c = 2 * (child + 1) - 1
    hk = jnp.where(last, hk.at[hole].set(hk[jnp.minimum(c, hk.shape[0] - 1)]), hk)
    hp = jnp.where(last, hp.at[hole].set(hp[jnp.minimum(c, hp.shape[0] - 1)]), hp)
    hole = jnp.where(last, c, hole)

    def up_more(st):
        hk, _, hole = st
        return (hole > top) & (hk[(hole - 1) // 2] < vk)

    def up(st):
        hk, hp, hole = st
        parent = (hole - 1) // 2
        return hk.at[hole].set(hk[parent]), hp.at[hole].set(hp[parent]), parent

    hk, hp, hole = lax.while_loop(up_more, up, (hk, hp, hole))
    return hk.at[hole].set(vk), hp.at[hole].set(vp)


def _partial_sort(keys, perm, k):
    """libstdc++'s ``std::partial_sort(first, first + k, last)`` of one row: heap_select, sort_heap."""
    n = keys.shape[0]
    hk, hp = keys[:k], perm[:k]

    def make(j, st):  # make_heap: adjust every parent, last first
        hk, hp = st
        parent = (k - 2) // 2 - j
        return _adjust_heap(hk, hp, parent, k, hk[parent], hp[parent])

    hk, hp = lax.fori_loop(0, max((k - 2) // 2 + 1, 0) if k > 1 else 0, make, (hk, hp))

    def select(i, st):  # an element better than the heap's worst replaces it
        hk, hp = st
        better = keys[i] < hk[0]
        nk, np_ = _adjust_heap(hk, hp, jnp.asarray(0, INT), k, keys[i], perm[i])
        return jnp.where(better, nk, hk), jnp.where(better, np_, hp)

    hk, hp = lax.fori_loop(k, n, select, (hk, hp))

    def pop(j, st):  # sort_heap: move the worst to the end of the shrinking heap
        hk, hp = st
        last = k - 1 - j
        vk, vp = hk[last], hp[last]
        hk, hp = hk.at[last].set(hk[0]), hp.at[last].set(hp[0])
        return _adjust_heap(hk, hp, jnp.asarray(0, INT), last, vk, vp)

    hk, hp = lax.fori_loop(0, k - 1, pop, (hk, hp))
    return hp


def topk_order(keys, k: int, sort_prefix: bool = True):
    """Rows of int ranks (rows, n) -> original positions of torch's CPU ``topk``, smallest ranks
    first: ``std::nth_element`` at k-1, then (``sort_prefix``: topk's sorted=True) ``std::sort`` of the
    first k-1 — for k * 64 > n; else std::partial_sort (a heap, replayed element by element)."""
    rows, n = keys.shape
    perm = jnp.broadcast_to(jnp.arange(n, dtype=INT), (rows, n))
    if k == 0:
        return perm[:, :0]
    if k * 64 <= n:
        return jax.vmap(lambda kk, p: _partial_sort(kk, p, k))(keys.astype(INT), perm)
    nth = k - 1

    def row(kk, p):
        pos = jnp.arange(n, dtype=INT)
        depth = 2 * _floor_log2(n)

        def more(state):
            _, _, first, last, level = state
            return (last - first > 3) & (level < depth)

        def body(state):
            kk, p, first, last, level = state
            inside = (pos >= first) & (pos < last)
            s, e = jnp.where(inside, first, pos), jnp.where(inside, last, pos + 1)
            kk, p, cut = _libstdcxx_partition(kk, p, s, e, inside)
            c = cut[first]
            first, last = jnp.where(c <= nth, c, first), jnp.where(c <= nth, last, c)
            return kk, p, first, last, level + 1

        kk, p, first, last, _ = lax.while_loop(
            more, body, (kk, p, jnp.asarray(0, INT), jnp.asarray(n, INT), jnp.asarray(0, INT))
        )
        region = jnp.where(pos < first, 0, jnp.where(pos < last, 1, 2)).astype(INT)
        _, p = _stable_in_segments(jnp.where(region == 1, kk, 0), p, region)  # the final insertion sort
        return p

    def row_full(keys_row, p):
        # nth_element partitions while more than 3 elements are left; up to 3 it is an insertion sort
        p = row(keys_row, p) if n > 3 else lax.sort((keys_row, p), num_keys=1, is_stable=True)[1]
        kk = keys_row[p]
        if nth > 0 and sort_prefix:  # std::sort(first, first + k - 1)
            pos = jnp.arange(n, dtype=INT)
            in_prefix = pos < nth
            if nth > 16:  # (up to 16 elements std::sort is its insertion sort alone)
                s, e = jnp.where(in_prefix, 0, pos), jnp.where(in_prefix, nth, pos + 1)
                kk, p = _introsort(kk, p, s, e, 16, 2 * _floor_log2(nth))
            region = jnp.where(in_prefix, 0, 1).astype(INT)
            _, p = _stable_in_segments(jnp.where(in_prefix, kk, 0), p, region)
        return p[:k]

    return jax.vmap(row_full)(keys.astype(INT), perm)


def select_order(keys, kth: int):
    """Rows of int ranks (rows, n) -> the original position torch's CPU ``kthvalue`` reports for the
    0-based ``kth`` smallest: ATen's ``quick_select_template`` replayed partition by partition."""
    rows, n = keys.shape
    perm = jnp.broadcast_to(jnp.arange(n, dtype=INT), (rows, n))

    def swap(kk, p, i, j):
        idx = jnp.arange(n, dtype=INT)
        src = jnp.where(idx == i, j, jnp.where(idx == j, i, idx))
        return kk[src], p[src]

    def row(kk, p):
        pos = jnp.arange(n, dtype=INT)

        def more(state):
            _, _, lo, hi = state
            return hi > lo + 1

        def body(state):
            kk, p, lo, hi = state
            mid = lo + (hi - lo) // 2
            kk, p = swap(kk, p, mid, lo + 1)
            for i, j in ((lo + 1, hi), (lo, hi), (lo + 1, lo)):  # median of three: min, pivot, max
                do = kk[i] > kk[j]
                kk, p = swap(kk, p, jnp.where(do, i, 0), jnp.where(do, j, 0))
            piv = kk[lo]
            s, e = jnp.full((n,), lo, INT), jnp.full((n,), hi + 1, INT)
            # i scans lo+2..hi for k >= piv, j scans hi-1..lo+1 for k <= piv; sentinels hi+1 and lo
            lpos, rpos = _stoppers(kk, s, e, (pos >= lo + 2) & (pos <= hi), (pos >= lo + 1) & (pos < hi), piv, e, s)
            valid = (pos >= lo) & (pos <= hi) & (lpos < rpos)
            m = jnp.sum(valid.astype(INT))  # pairs swapped before the scans meet
            at = lambda arr, q: arr[jnp.clip(q, 0, n - 1)]  # noqa: E731
            step = m + (at(lpos, lo + m) == at(rpos, lo + m)).astype(INT)  # meeting on one element: once more
            # past the last swapped pair the scans stop on it at the latest
            i_fin = jnp.where(m == 0, at(lpos, lo + step), jnp.minimum(at(lpos, lo + step), at(rpos, lo + m - 1)))
            j_fin = jnp.where(m == 0, at(rpos, lo + step), jnp.maximum(at(rpos, lo + step), at(lpos, lo + m - 1)))
            kk, p = _swap_pairs(kk, p, lpos, rpos, valid)
            kk, p = swap(kk, p, lo, j_fin)
            lo, hi = jnp.where(j_fin <= kth, i_fin, lo), jnp.where(j_fin >= kth, j_fin - 1, hi)
            return kk, p, lo, hi

        kk, p, lo, hi = lax.while_loop(more, body, (kk, p, jnp.asarray(0, INT), jnp.asarray(n - 1, INT)))
        do = (hi == lo + 1) & (kk[lo] > kk[jnp.minimum(hi, n - 1)])  # two elements left
        kk, p = swap(kk, p, jnp.where(do, lo, 0), jnp.where(do, hi, 0))
        return p[kth]

    return jax.vmap(row)(keys.astype(INT), perm)


def neighbours_equal(values):
    """(..., n-1): sorted neighbours i and i+1 of ``values`` (sorted axis last) are equal for torch's
    comparators (all NaNs are equal to each other)."""
    same = values[..., 1:] == values[..., :-1]
    if jnp.issubdtype(values.dtype, jnp.inexact):
        same = same | (jnp.isnan(values[..., 1:]) & jnp.isnan(values[..., :-1]))
    return same


def rank_keys(values, idx):
    """Integer ranks of the original elements, from their stable sort (``values``, ``idx``, sorted axis
    last), in torch's comparator order: equal elements, and all NaNs, share a rank."""
    same = neighbours_equal(values)
    ranks = jnp.concatenate([jnp.zeros(values.shape[:-1] + (1,), INT), jnp.cumsum((~same).astype(INT), -1)], -1)
    return jnp.put_along_axis(jnp.zeros(ranks.shape, INT), idx.astype(INT), ranks, axis=-1, inplace=False)
