"""The engine core: one model forward per step for every query of every tree.

:class:`TreeEngine` holds the tree cache and a :class:`~deft.engine.runner.ModelRunner`
(the model on its device: pool, attention, graphs). Callers grow the tree
(``add_prompt``, ``cache.fork``, ``extend``, ``extend_tree``, or both kinds at once with
``forward``) and every call that computes runs exactly ONE forward: the engine builds the
step (:class:`~deft.engine.step.Step`), the runner plans its layout once and runs the
model, and only the logits rows the caller asked for go through the LM head. Decoding
policy lives in the
strategies built on top (:mod:`deft.engine.strategies`: ``generate``, ``sample``,
``beam_search``, ``tree_search``, speculative decoding, trace replay).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from ..cache import CacheFullError, TreeKVCache
from ..checks import context_text, is_int
from ..layout import as_index_array
from .config import EngineConfig
from .runner import STAT_KEYS, ModelRunner
from .step import Feed, build_step

__all__ = ["TreeEngine", "LOGITS_MODES"]

LOGITS_MODES = ("last", "all", "none")
_I = np.int64
_KNOWN_TREES = 8  # draft tree shapes whose depths _depths remembers


class TreeEngine:
    """A model, its K/V pool and the tree cache, run one forward per step.

    Parameters
    ----------
    model, tokenizer:
        From :func:`deft.model.load_model` (any model keeping the
        :class:`~deft.model.DecoderModel` contract; a tokenizer with ``encode``/``decode``).
    config:
        An :class:`~deft.engine.EngineConfig`; ``options`` replace its fields (or the
        defaults'), e.g. ``TreeEngine(model, tok, num_pages=512, backend="torch")``; an int
        in its place and the next argument are ``num_pages`` and ``page_size``. Pool
        geometry, attention backend and plan kind, device (the model's by default, and of
        its kind), I/O counting, prefill chunk, CUDA graphs and their buckets, the decode
        loop's overlap and the K/V format are all there.
    tp_group:
        Tensor parallelism: the :class:`~deft.distributed.TPGroup` whose rank's shard
        ``model`` is (``load_model(..., tp=group)``). Rank 0 uses the engine as usual and
        each step goes to every rank; the other ranks call :meth:`follow`. Rank 0 ends the
        job with :meth:`close` (or a ``with`` block).

    The engine holds the tree (:class:`~deft.TreeKVCache`, host bookkeeping) and builds
    each forward as a :class:`~deft.engine.step.Step`; its
    :class:`~deft.engine.runner.ModelRunner` owns the device side (pool, attention, CUDA
    graphs) and runs it. Change the tree through the engine (``add_prompt``, ``extend``,
    ``extend_tree``) or the cache's own ``fork``/``prune``/``split``/``commit_path``; the
    position of a token is its depth, read from the cache. ``stats`` accumulates
    ``steps``, ``tokens`` (queries computed), ``logit_rows``, ``forward_s``, ``plan_s``
    (layout and plan, part of ``forward_s``), ``graph_steps`` (steps replayed as graphs)
    and ``plan_tokens`` (K/V tokens the steps' plans load per layer and KV head); while
    ``count_io`` is true also ``kv_bytes_deft`` and ``kv_bytes_per_branch`` (K/V bytes all
    layers read under DeFT's plan and under per-branch decoding, where each query reads its
    whole path) and ``io_s``, the time that counting took (outside ``forward_s``).
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | int | None = None,
                 page_size: int | None = None, tp_group: Any = None, **options: Any) -> None:
        if is_int(config):  # TreeEngine(model, tokenizer, num_pages, page_size)
            config, options["num_pages"] = None, config
        if page_size is not None:
            options["page_size"] = page_size
        config = EngineConfig.of(config, **options)
        if not (callable(getattr(tokenizer, "encode", None))
                and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(f"tokenizer: expected a deft Tokenizer (encode, decode), got "
                            f"{type(tokenizer).__name__}")
        self.config, self.tokenizer = config, tokenizer
        self.stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)
        self.runner = ModelRunner(model, config, self.stats, tp_group)
        self.device = self.runner.device
        # Rows moved by committed paths, for the next step (the cache holds the list, not
        # the engine: no cycle keeps a dropped engine's pool alive).
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        self._copies = copies
        self.cache = TreeKVCache(config.num_pages, config.page_size,
                                 on_copy=lambda src, dst: copies.append((src, dst)))
        self.overlap = self.device.type == "cuda" if config.overlap is None else config.overlap
        self.prefill_chunk = config.prefill_chunk
        self.vocab_size = model.config.vocab_size
        self.max_positions = model.config.max_position_embeddings
        # "the model's context of N" and what capped it, for errors
        self.context_text = getattr(model.config, "context_text", context_text(self.max_positions))
        self._staged: list[Feed] = []
        self._tree_depths: dict[bytes, tuple[np.ndarray, int]] = {}  # see _depths

    model = property(lambda self: self.runner.model, doc="The runner's model.")
    pool = property(lambda self: self.runner.pool, doc="The runner's K/V pool.")
    attn = property(lambda self: self.runner.attn, doc="The runner's step attention.")
    graphs = property(lambda self: self.runner.graphs, doc="The runner's CUDA graphs, if any.")

    @property
    def count_io(self) -> bool:
        """Whether steps count the K/V bytes they read (see ``stats``); settable."""
        return self.runner.count_io

    @count_io.setter
    def count_io(self, on: bool) -> None:
        self.runner.count_io = bool(on)

    def __repr__(self) -> str:
        c = self.config
        return (f"TreeEngine(layers={self.pool.num_layers}, pages={c.num_pages}x{c.page_size}, "
                f"backend={self.attn.backend_name!r}, device={str(self.device)!r})")

    def calibrate(self, token_ids: Sequence[int]) -> None:
        """Compute ``token_ids`` as a throwaway prompt. A scaled K/V pool (FP8) that has no
        scales yet takes them from this step, so no request's own K/V set them for the
        others (a server calibrates so at start-up); nothing else changes."""
        ids = list(token_ids)
        if not ids:
            raise ValueError("token_ids: expected at least one token id, got none")
        root = self.add_prompt(ids[:-1])
        try:
            self.extend([(root, ids[-1:])], logits="none")
        finally:
            self.cache.prune(root)

    def follow(self) -> int:
        """A tensor-parallel rank other than 0: run rank 0's steps until it closes its
        engine; returns the number of steps run."""
        return self.runner.follow()

    def close(self) -> None:
        """Tensor-parallel rank 0: release the other ranks from :meth:`follow` (idempotent;
        the engine runs no step after). Nothing to do on one device."""
        self.runner.close()

    def __enter__(self) -> "TreeEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_stats(self) -> None:
        """Zero the counters in :attr:`stats`."""
        self.stats.update(dict.fromkeys(STAT_KEYS, 0))

    # ------------------------------------------------------------------ tree

    def position(self, node: int) -> int:
        """Number of tokens on the path root..``node``: the position of its next token."""
        return self.cache.position(node)

    def add_prompt(self, token_ids: Sequence[int]) -> int:
        """A new root holding ``token_ids`` (may be empty); returns its node id.

        The slots are taken now (so the root can be forked at once) and the K/V are
        computed by the next forward (``extend``/``extend_tree(s)``) together with that
        call's own items; no logits are kept for them. To get the prompt's last logits,
        hold its last token back: ``root = add_prompt(ids[:-1]); extend([(root,
        ids[-1:])])``, or start empty and prefill in chunks with ``extend``. Raises
        ``ValueError`` for bad ids or a prompt longer than the model's context.
        """
        ids = self._check_tokens(token_ids, "token_ids", allow_empty=True)
        if ids.shape[0] > self.max_positions:
            raise ValueError(f"token_ids: the prompt has {ids.shape[0]} tokens, more than "
                             f"{self.context_text}")
        self._check_pages([ids.shape[0]])
        root = self.cache.add_root(0)
        if ids.shape[0]:
            self._stage(root, ids, "none")
        return root

    # --------------------------------------------------------------- forward

    def extend(
        self, items: Sequence[tuple[int, Sequence[int]]], logits: str | Sequence[str] = "last",
        device_tokens: tuple[torch.Tensor, Sequence[int]] | None = None,
    ) -> list[torch.Tensor]:
        """Append each item's tokens to its node and compute them all in ONE forward.

        ``items``: ``(node, token_ids)`` pairs; each node must have no children (the same
        node may appear twice: the second run follows the first). Each token's query sees
        its path, its own node's earlier tokens included (chunked prefill). Anything
        staged by :meth:`add_prompt` is computed in the same forward.

        ``logits``: per call or per item, ``"last"`` -> float32 ``[vocab]`` of the item's
        last token, ``"all"`` -> ``[n, vocab]``, ``"none"`` -> ``[0, vocab]`` (no LM head).

        ``device_tokens``: ``(values, sources)``, an int64 tensor on the engine's device and
        one index per item; an item whose source is ``>= 0`` holds one token whose id is
        ``values[source]``, read on the device (tokens sampled by the last step feed the next
        without a host round trip; the id in ``items`` is a placeholder). Returns at once:
        the logits are computed in the stream's order, nothing waits for them.

        Raises ``ValueError`` (bad node, token ids, context overflow) or
        :class:`~deft.CacheFullError` before anything changes. The page check is
        conservative: it needs ``sum(ceil(n / page_size))`` free pages.
        """
        return self.forward(items, (), logits, device_tokens)[0]

    def extend_tree(
        self, node: int, parents: Sequence[int], token_ids: Sequence[int]
    ) -> tuple[list[int], torch.Tensor]:
        """Add a draft tree under ``node`` and compute all of its tokens in ONE forward.

        Draft token ``i`` becomes a 1-token node, a child of ``node`` if ``parents[i] ==
        -1``, else of draft ``parents[i] < i`` (``TreeKVCache.add_subtree``); its query
        sees the path to it. Returns the new node ids and float32 logits
        ``[len(token_ids), vocab]``.
        """
        ((ids, logits),) = self.extend_trees([(node, parents, token_ids)])
        return ids, logits

    def extend_trees(
        self, trees: Sequence[tuple[int, Sequence[int], Sequence[int]]]
    ) -> list[tuple[list[int], torch.Tensor]]:
        """Several :meth:`extend_tree` calls (``(node, parents, token_ids)`` each) in one forward."""
        return self.forward((), trees)[1]

    def forward(
        self,
        items: Sequence[tuple[int, Sequence[int]]] = (),
        trees: Sequence[tuple[int, Sequence[int], Sequence[int]]] = (),
        logits: str | Sequence[str] = "last",
        device_tokens: tuple[torch.Tensor, Sequence[int]] | None = None,
    ) -> tuple[list[torch.Tensor], list[tuple[list[int], torch.Tensor]]]:
        """:meth:`extend`'s ``items`` and :meth:`extend_trees`' ``trees`` in ONE forward.

        Returns what each of those returns: per item its logits (``logits`` and
        ``device_tokens`` are per item, as for :meth:`extend`), per tree its new node ids
        and logits ``[len(token_ids), vocab]``. A tree's node must not also grow by an item
        of the same call. Everything is checked before anything changes, as for both.
        """
        modes = self._check_modes(logits, len(items))
        checked, grow = [], {}
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"items[{i}]: expected a (node, token_ids) pair, got {item!r}")
            node, toks = item
            name = f"items[{i}]"
            self._check_leaf(node, name)
            ids = self._check_tokens(toks, name)
            grow[node] = grow.get(node, 0) + ids.shape[0]
            self._check_context(node, grow[node], name)
            checked.append((node, ids))
        sources, values = self._check_sources(device_tokens, checked)
        drafts = [self._check_tree(i, tree, grow) for i, tree in enumerate(trees)]
        self._check_pages([ids.shape[0] for _, ids in checked] + [d[2].shape[0] for d in drafts])
        start = len(self._staged)
        held = self._stage_items(checked, modes, sources)
        new_ids = []
        for node, par, ids, positions in drafts:
            nodes, slots = self.cache.add_subtree(node, par, 1)
            self._staged.append(Feed(nodes, np.ones(len(nodes), _I), ids, positions, slots, "all"))
            new_ids.append(nodes)
        out = self._step(values)[start:]
        rows: list[torch.Tensor] = []
        for n, got in zip(held, out):  # (a feed staged in this call keeps its nodes: no None)
            rows += [got] if n == 0 else list(got)  # an item's logits, or ``n`` items' rows
        return rows, list(zip(new_ids, out[len(held):]))

    # -------------------------------------------------------------- internals

    def _stage_items(self, checked: list[tuple[int, np.ndarray]], modes: list[str],
                     sources: list[int]) -> list[int]:
        """Stage checked items in order: each run of one-token items whose last logits are
        wanted and whose token is on the host (a decode step's beams and branches) as one
        feed of every row, the others one feed each. Per feed staged, the items it holds
        (``0``: one, a feed of its own)."""
        held: list[int] = []
        run: list[tuple[int, np.ndarray]] = []
        for item, mode, src in zip(checked, modes, sources):
            if item[1].shape[0] == 1 and mode == "last" and src < 0:
                run.append(item)
                continue
            if run:
                held.append(self._stage_tokens(run))
                run = []
            self._stage(*item, mode, src)
            held.append(0)
        if run:
            held.append(self._stage_tokens(run))
        return held

    def _stage_tokens(self, items: list[tuple[int, np.ndarray]]) -> int:
        """Append each of ``items``' one token to its node as one feed of every row (slots
        now, K/V at the next forward); returns how many items it holds."""
        nodes = [node for node, _ in items]
        slots, lens, positions = self.cache.append_each(nodes)
        ids = np.concatenate([ids for _, ids in items])
        self._staged.append(Feed(nodes, lens, ids, positions, slots, "all"))
        return len(items)

    def _stage(self, node: int, ids: np.ndarray, mode: str, source: int = -1) -> None:
        """Append ``ids`` to ``node`` (slots now, K/V at the next forward)."""
        n, have = ids.shape[0], self.cache.num_tokens(node)
        base = self.cache.position(node)
        slots = self.cache.append(node, n)
        self._staged.append(Feed([node] * n, np.arange(have + 1, have + n + 1, dtype=_I), ids,
                                 np.arange(base, base + n, dtype=_I), slots, mode, source))

    def _step(self, values: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """Run every staged feed in one forward; per staged feed the logits its mode asked
        for (``None`` for one whose node was pruned since: it is dropped). A feed with a
        ``source`` takes its token from ``values`` on the device."""
        staged, self._staged = self._staged, []
        # A feed's nodes are staged together: its first stands for all of them.
        kept = [i for i, f in enumerate(staged) if self.cache.is_live(f.nodes[0])]
        result: list[torch.Tensor | None] = [None] * len(staged)
        if not kept:
            return result
        feeds = [staged[i] for i in kept]
        t0 = time.perf_counter()
        step, bounds = build_step(self.cache, feeds, values, tuple(self._copies))
        self.stats["plan_s"] += time.perf_counter() - t0  # the layout; the runner adds the plan
        out = self.runner.run(step)
        self._copies.clear()  # applied (kept for the next step if the run raised)
        st = self.stats
        st["steps"] += 1
        st["tokens"] += step.num_queries
        st["logit_rows"] += step.logits_rows.shape[0]
        st["forward_s"] += time.perf_counter() - t0
        for i, f, (a, b) in zip(kept, feeds, bounds):
            result[i] = out[a] if f.logits == "last" else out[a:b]
        return result

    def _check_tree(self, i: int, tree: Any, grow: dict[int, int]
                    ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """``trees[i]`` checked: its node, parents, token ids and positions."""
        if not isinstance(tree, (tuple, list)) or len(tree) != 3:
            raise ValueError(f"trees[{i}]: expected a (node, parents, token_ids) triple, got {tree!r}")
        node, parents, toks = tree
        self.cache.num_tokens(node)  # validates the id
        if node in grow:
            raise ValueError(f"trees[{i}]: node {node} also grows by an item of this call")
        par = as_index_array(parents, f"trees[{i}] parents")
        ids = self._check_tokens(toks, f"trees[{i}] token_ids")
        if par.shape != ids.shape:
            raise ValueError(f"trees[{i}]: expected as many parents as token_ids, "
                             f"got {par.shape[0]} and {ids.shape[0]}")
        depth, height = self._depths(par, f"trees[{i}] parents")
        base = self._check_context(node, height, f"trees[{i}]")
        return node, par, ids, base + depth

    def _depths(self, par: np.ndarray, name: str) -> tuple[np.ndarray, int]:
        """``[m]`` each draft's depth in the tree ``par`` (checked) and the tree's height.

        Remembered for the last few distinct trees: speculative decoding drafts the same
        tree shape every step.
        """
        key = par.tobytes()
        known = self._tree_depths.get(key)
        if known is not None:
            return known
        bad = (par < -1) | (par >= np.arange(par.shape[0]))
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"{name}[{j}]: expected -1 or an earlier index in [0, {j}), "
                             f"got {int(par[j])}")
        depth: list[int] = []
        for p in par.tolist():
            depth.append(0 if p < 0 else depth[p] + 1)
        if len(self._tree_depths) >= _KNOWN_TREES:
            del self._tree_depths[next(iter(self._tree_depths))]
        depths = np.array(depth, _I)
        depths.setflags(write=False)
        self._tree_depths[key] = known = (depths, max(depth, default=-1) + 1)
        return known

    def _check_sources(self, device_tokens: tuple[torch.Tensor, Sequence[int]] | None,
                       checked: list[tuple[int, np.ndarray]]) -> tuple[list[int], torch.Tensor | None]:
        """Per item its device-token source (``-1``: none), and the values tensor."""
        if device_tokens is None:
            return [-1] * len(checked), None
        values, sources = device_tokens
        if not isinstance(values, torch.Tensor) or values.ndim != 1 or values.dtype != torch.int64 \
                or values.device.type != self.device.type:
            raise ValueError(f"device_tokens: expected a 1-D int64 tensor on {self.device}, got "
                             f"{getattr(values, 'dtype', type(values).__name__)} "
                             f"on {getattr(values, 'device', None)}")
        src = as_index_array(sources, "device_tokens sources")
        if src.shape[0] != len(checked):
            raise ValueError(f"device_tokens: expected one source per item ({len(checked)}), "
                             f"got {src.shape[0]}")
        for i, (s, (_, ids)) in enumerate(zip(src.tolist(), checked)):
            if not -1 <= s < values.shape[0]:
                raise ValueError(f"device_tokens sources[{i}]: expected -1 or an index in "
                                 f"[0, {values.shape[0]}), got {s}")
            if s >= 0 and ids.shape[0] != 1:
                raise ValueError(f"items[{i}]: a device token source needs exactly one "
                                 f"(placeholder) token id, got {ids.shape[0]}")
        return src.tolist(), values

    def _check_modes(self, logits: str | Sequence[str], n: int) -> list[str]:
        modes = [logits] * n if isinstance(logits, str) else list(logits)
        if len(modes) != n:
            raise ValueError(f"logits: expected one mode per item ({n}), got {len(modes)}")
        for m in modes:
            if m not in LOGITS_MODES:
                raise ValueError(f"logits: expected one of {', '.join(LOGITS_MODES)}, got {m!r}")
        return modes

    def _check_leaf(self, node: Any, name: str) -> None:
        children = self.cache.children(node) if is_int(node) else None
        if children is None:
            raise ValueError(f"{name}: expected a node id, got {node!r}")
        if children:
            raise ValueError(f"{name}: node {node} has children {children}; only a node "
                             "without children can grow (fork it instead)")

    def _check_tokens(self, tokens: Any, name: str, allow_empty: bool = False) -> np.ndarray:
        if (type(tokens) is list and 0 < len(tokens) <= 16  # a decode step's few valid ids
                and all(type(t) is int and 0 <= t < self.vocab_size for t in tokens)):
            return np.array(tokens, _I)
        if isinstance(tokens, (str, bytes)):
            raise TypeError(f"{name}: expected token ids, got a {type(tokens).__name__} "
                            "(encode text with the tokenizer first)")
        ids = as_index_array(tokens, name)
        if not allow_empty and ids.shape[0] == 0:
            raise ValueError(f"{name}: expected at least one token id, got none")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"{name}: token id {int(ids[j])} at index {j} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        return ids.copy()

    def _check_context(self, node: int, n: int, name: str) -> int:
        """Position of ``node``'s next token, checked to leave room for ``n`` more."""
        base = self.position(node)
        if base + n > self.max_positions:
            raise ValueError(f"{name}: node {node} would reach {base + n} tokens, more than "
                             f"{self.context_text}")
        return base

    def _check_pages(self, counts: list[int]) -> None:
        """Raise :class:`CacheFullError` unless appends of ``counts`` tokens surely fit.

        Conservative: each append may need ``ceil(n / page_size)`` fresh pages.
        """
        ps = self.config.page_size
        need = sum(-(-n // ps) for n in counts)
        if need > self.cache.num_free_pages:
            raise CacheFullError(need, self.cache.num_free_pages, self.cache.num_pages)
