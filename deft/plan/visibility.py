"""The compact visibility predicate: which query rows see which plan tokens.

A plan token carries ``lo, hi`` (the preorder interval of its node's subtree) and ``off``
(its offset in the node); a query carries ``pre`` (its node's preorder index) and ``qlen``
(its ``query_kv_len``). The query sees the token iff its node lies in the token node's
subtree and, on that node itself, the token is among its first ``qlen``. The expression
uses only comparison and bit operators, so the same function serves numpy, torch and
(wrapped with ``triton.jit``) the kernels, on broadcast operands.
"""

__all__ = ["visible"]


def visible(pre, qlen, lo, hi, off):
    """Boolean ``pre``/``qlen`` (query) against ``lo``/``hi``/``off`` (token), broadcast."""
    return (lo <= pre) & (pre < hi) & ((pre != lo) | (off < qlen))
