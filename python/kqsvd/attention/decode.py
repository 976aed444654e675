"""Attention over what a cache layer holds: the products of queries with
keys and of weights with values, a KV head's query heads stacked as rows
of one product (grouped-query attention)."""


def gqa_scores(q, k):
    """q [b, Hq, T, w] against k [b, Hk, N, w], Hq a multiple of Hk:
    [b, Hq, T, N].  A KV head's queries are stacked as rows of one product
    (a broadcast batch dimension would copy k for each)."""
    b, hq, T, w = q.shape
    hk = k.shape[1]
    return (q.reshape(b, hk, hq // hk * T, w) @ k.transpose(-1, -2)).view(b, hq, T, -1)


def gqa_weigh(p, v):
    """Weights p [b, Hq, T, N] times values v [b, Hk, N, r]: [b, Hq, T, r]."""
    b, hq, T, N = p.shape
    hk = v.shape[1]
    return (p.reshape(b, hk, hq // hk * T, N) @ v).view(b, hq, T, -1)
