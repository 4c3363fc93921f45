"""The Llama-family decoder whose attention runs through :class:`deft.TreeAttention`.

One :meth:`LlamaModel.forward` computes every query of every tree in a step: prompt
chunks and decode tokens alike. The caller (the engine) owns the layout: it plans a
``TreeAttention`` for the step's queries and picks the cache slot of each new token.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import TreeAttention
from ..cache.pool import KVPool, KVSpec
from .config import LlamaConfig
from .rope import apply_rope, identity_table, rope_table

__all__ = ["LlamaModel", "build_model", "fuse_hf_weights"]


# The MLP gate's activation by its config name (:data:`~deft.model.config.ACTIVATIONS`).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class RMSNorm(nn.Module):
    """``w * x / rms(x)``, normalised in float32: rounded back before the scaling by ``w``
    (Llama), or, with ``plus_one``, scaled by ``1 + w`` in float32 and rounded last (Gemma)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


@lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (Gemma's embedding scale is a tensor of the weights' dtype)."""
    return torch.tensor(value, dtype=dtype).item()


class LlamaLayer(nn.Module):
    """Pre-norm attention block and gated MLP; q/k/v and gate/up are fused projections
    (with the config's family flags: q/k/v biases, per-head q/k norms, Gemma's norms
    after attention and MLP, GeGLU)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, c.rms_norm_eps, c.norm_plus_one)

        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.attn_norm = norm(c.hidden_size)
        self.qkv = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                             bias=c.attention_bias or c.qkv_bias)
        self.o = nn.Linear(self.q_size, c.hidden_size, bias=c.attention_bias)
        self.q_norm = norm(c.head_dim) if c.qk_norm else None
        self.k_norm = norm(c.head_dim) if c.qk_norm else None
        self.post_attn_norm = norm(c.hidden_size) if c.sandwich_norms else None
        self.mlp_norm = norm(c.hidden_size)
        self.post_mlp_norm = norm(c.hidden_size) if c.sandwich_norms else None
        self.act = _ACTIVATIONS[c.hidden_act]
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        # Under tensor parallelism (a rank's shard of the heads and MLP): the sum over ranks
        # of the row-parallel o and down outputs, in place; ``None`` on one device.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _reduced(self, t: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """``t`` summed over the ranks, then normalised by ``norm`` where there is one."""
        t = t if self.all_reduce is None else self.all_reduce(t)
        return t if norm is None else norm(t)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor | None,  # [N, 1, D/2]; None: no RoPE in this layer (nope_layers)
        sin: torch.Tensor | None,  # [N, 1, D/2]
        write_slots: torch.Tensor,  # [N]
        attn: TreeAttention,
        pool: KVPool,
        layer: int,
        captured: bool = False,  # launched into a CUDA graph (or its warm-up)
    ) -> torch.Tensor:
        n, h, h_kv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.project_qkv(self.attn_norm(x))
        qk = qkv[:, :h + h_kv]
        if cos is not None:
            qk = apply_rope(qk, cos, sin)  # q and k heads rotated together
        pool.write(layer, write_slots, qk[:, h:], qkv[:, h + h_kv:])
        k_scale, v_scale = pool.scales(layer)
        o = attn.run(qk[:, :h].contiguous(), pool.k_slots[layer], pool.v_slots[layer],
                     k_scale=k_scale, v_scale=v_scale, captured=captured)  # [N, H, D]
        x = x + self._reduced(self.o(o.reshape(n, self.q_size)), self.post_attn_norm)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self._reduced(self.down(self.act(gate) * up), self.post_mlp_norm)

    def project_qkv(self, normed: torch.Tensor,
                    linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
        """``[N, H + 2 H_kv, D]``: the q, k and v heads of ``normed [N, hidden]`` (projected by
        ``linear(x, weight, bias)``), q and k RMS-normalised per head where the config says so."""
        qkv = linear(normed, self.qkv.weight, self.qkv.bias).view(normed.shape[0], -1,
                                                                   self.head_dim)
        if self.q_norm is None:
            return qkv
        h, h_kv = self.num_heads, self.num_kv_heads
        return torch.cat([self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h:h + h_kv]),
                          qkv[:, h + h_kv:]], dim=1)

    def forward_fused(
        self,
        x: torch.Tensor,  # [N, hidden]: the residual stream before ``delta`` is added
        delta: torch.Tensor | None,  # [N, hidden]: the previous layer's MLP output
        positions: torch.Tensor,  # [N]
        table: torch.Tensor,  # [max_positions, D]: the model's cos/sin table
        write_slots: torch.Tensor,
        attn: TreeAttention,
        pool: KVPool,
        layer: int,
        out: torch.Tensor,  # [N, H, D]: where attention writes (one buffer for every layer)
        captured: bool,  # launched into a CUDA graph (or its warm-up)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` through the fused kernels of :mod:`.fused` (a
        :attr:`~LlamaConfig.fusable` config; a pool of the activations' dtype, or a calibrated
        scaled one: the RoPE write quantises); returns
        the residual stream and this layer's MLP output, which the next layer's norm adds."""
        from . import fused, skinny

        n, h = x.shape[0], self.num_heads
        normed, x = fused.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps, delta)
        qkv = self.project_qkv(normed, partial(skinny.qkv, captured=captured))
        k, v = pool.k_slots[layer], pool.v_slots[layer]
        k_scale, v_scale = pool.scales(layer)
        q = fused.rope_write(qkv, table, positions, write_slots, k, v, h, k_scale, v_scale)
        o = attn.run(q, k, v, out=out, k_scale=k_scale, v_scale=v_scale, captured=captured)
        attn_out = self._reduced(skinny.linear(o.reshape(n, self.q_size), self.o.weight,
                                               self.o.bias, captured))
        normed, x = fused.rms_norm(x, self.mlp_norm.weight, self.mlp_norm.eps, attn_out)
        act = skinny.gated(normed, self.gate_up.weight, self.gate_up.bias, captured)
        return x, self._reduced(skinny.linear(act, self.down.weight, self.down.bias, captured))


class LlamaModel(nn.Module):
    """Llama-family causal LM over a tree KV cache.

    Build one with :func:`deft.model.load_model`, or ``LlamaModel(config)`` (random
    weights, e.g. for tests) followed by ``load_state_dict``.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
        self.config = config
        # Initialised by hand: nn.Embedding's normal_ on the meta device (see build_model)
        # imports torch._dynamo, which costs seconds.
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size,
                                  _weight=torch.empty(config.vocab_size, config.hidden_size))
        if not self.embed.weight.is_meta:
            nn.init.normal_(self.embed.weight)
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # On CUDA, the layers' memory-bound ops run as the fused kernels of ``deft.model.fused``
        # (``None``); ``False``: the plain PyTorch ops everywhere; ``True``: fused on any
        # device Triton runs on (CPU tensors when it interprets, for tests). A config that
        # is not ``fusable`` takes the plain ops whatever this says.
        self.fused_ops: bool | None = None
        # The tensor-parallel group this model is one rank's shard for (its config is the
        # rank's: its heads and MLP rows; see :mod:`.sharding`); ``None`` on one device.
        self.tp: Any = None
        # [max_positions, D]: cos then sin of every position's angles (not a checkpoint tensor).
        self.register_buffer("rope", rope_table(config, self.embed.weight.dtype,
                                                self.embed.weight.device), persistent=False)
        # The same of the config's local_rope_layers, where it has some.
        self.register_buffer("local_rope", rope_table(
            config, self.embed.weight.dtype, self.embed.weight.device, local=True)
            if config.local_rope_layers else None, persistent=False)
        self._local = frozenset(config.local_rope_layers)
        # The fused path's table of the config's nope_layers: the identity rotation.
        self.register_buffer("nope_rope", identity_table(
            config, self.embed.weight.dtype, self.embed.weight.device)
            if config.nope_layers else None, persistent=False)
        self._nope = frozenset(config.nope_layers)

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (and the K/V pool's)."""
        return self.embed.weight.dtype

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]``: the embeddings of ``input_ids [N]``, times the config's
        ``embed_scale`` rounded to their dtype."""
        x = self.embed(input_ids)
        scale = self.config.embed_scale
        return x if scale == 1.0 else x * _rounded(scale, x.dtype)

    def attention(
        self, device: str | torch.device | None = None, backend: str = "auto", **kwargs: Any
    ) -> TreeAttention:
        """A :class:`TreeAttention` of this model's heads and softmax scale on ``device``
        (default: the model's)."""
        c = self.config
        return TreeAttention(c.num_heads, c.num_kv_heads, c.head_dim, sm_scale=c.sm_scale,
                             backend=backend, device=self.device if device is None else device,
                             **kwargs)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)``: what a K/V pool of this model holds."""
        c = self.config
        return c.num_layers, c.num_kv_heads, c.head_dim

    def new_pool(
        self,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        spec: KVSpec | None = None,
    ) -> KVPool:
        """A :class:`KVPool` for every layer of this model (default: the model's dtype and
        device; ``spec`` gives another K/V format)."""
        layers, heads, dim = self.kv_shape
        return KVPool(layers, num_pages, page_size, heads, dim,
                      dtype=self.dtype if dtype is None else dtype,
                      device=self.device if device is None else device, spec=spec)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        attn: TreeAttention,
        pool: KVPool,
        logits_rows: torch.Tensor | None = None,
        captured: bool = False,
    ) -> torch.Tensor:
        """Logits of one step's queries.

        Parameters
        ----------
        input_ids, positions, write_slots:
            ``[N]`` int64: token, absolute position (for RoPE, < ``max_position_embeddings``)
            and cache slot of each new token, in the order of ``attn``'s planned queries.
        attn:
            A :class:`TreeAttention` planned for this step; query ``i`` is token ``i`` and
            its visible KV includes its own slot ``write_slots[i]``.
        pool:
            The K/V pool (every layer); the new tokens' K/V are written into it.
        logits_rows:
            ``[R]`` rows whose logits are wanted (e.g. each prompt's last token); all by default.
        captured:
            The step is being captured into a CUDA graph, or is its warm-up: kernels that
            only pay off inside graphs are launched.

        Returns
        -------
        ``[N or R, vocab_size]`` logits in float32 (float64 for a float64 model).
        """
        self._check_step(input_ids, positions, write_slots, attn, pool, logits_rows)
        c = self.config
        x = self.embed_tokens(input_ids)  # [N, hidden]
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        # A scaled pool takes the fused path once calibrated (calibration reads the K/V
        # that pool.write gets).
        if (c.fusable and x.dtype != torch.float64 and (pool.dtype == x.dtype or pool.spec.scaled)
                and pool.calibrated and (self.fused_ops or (self.fused_ops is None and x.is_cuda))):
            from .fused import rms_norm
            from .skinny import head_proj

            delta = None
            # Each layer's attention output is read by its o projection before the next
            # layer writes it (stream order): one buffer serves them all.
            out = torch.empty((x.shape[0], c.num_heads, c.head_dim), dtype=x.dtype, device=x.device)
            for i, layer in enumerate(self.layers):
                table = self.nope_rope if i in self._nope else self.rope
                x, delta = layer.forward_fused(x, delta, positions, table, write_slots,
                                               attn, pool, i, out, captured)
            if logits_rows is not None:
                x, delta = x[logits_rows], delta[logits_rows]
            return head_proj(rms_norm(x, self.norm.weight, self.norm.eps, delta)[0], head,
                             captured)
        # cos, sin: [N, 1, D/2] each, of every layer's RoPE table
        rope, local = (None if t is None else t[positions].unsqueeze(1).chunk(2, dim=-1)
                       for t in (self.rope, self.local_rope))
        for i, layer in enumerate(self.layers):
            cos_sin = (None, None) if i in self._nope else local if i in self._local else rope
            x = layer(x, *cos_sin, write_slots, attn, pool, i, captured)
        if logits_rows is not None:
            x = x[logits_rows]
        logits = F.linear(self.norm(x), head)  # [N or R, vocab]
        return logits if logits.dtype == torch.float64 else logits.float()

    def _check_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        attn: TreeAttention,
        pool: KVPool,
        logits_rows: torch.Tensor | None,
    ) -> None:
        c = self.config
        named = [("input_ids", input_ids), ("positions", positions), ("write_slots", write_slots)]
        if logits_rows is not None:
            named.append(("logits_rows", logits_rows))
        for name, t in named:
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name}: expected a 1-D int64 tensor, got {got}")
            if t.device.type != self.device.type:
                raise ValueError(f"{name}: expected device {self.device} (the model's), got {t.device}")
        n = input_ids.shape[0]
        for name, t in named[1:3]:
            if t.shape[0] != n:
                raise ValueError(f"{name}: expected length {n} like input_ids, got {t.shape[0]}")
        if not isinstance(attn, TreeAttention):
            raise TypeError(f"attn: expected a deft.TreeAttention, got {type(attn).__name__}")
        if (attn.num_qo_heads, attn.num_kv_heads, attn.head_dim) != (c.num_heads, c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"attn: expected heads/kv heads/head dim {c.num_heads}/{c.num_kv_heads}/{c.head_dim}, "
                f"got {attn.num_qo_heads}/{attn.num_kv_heads}/{attn.head_dim}"
            )
        if attn.current_plan.num_queries != n:
            raise ValueError(
                f"attn: expected a plan for {n} queries (one per input token), "
                f"got {attn.current_plan.num_queries}"
            )
        if not isinstance(pool, KVPool):
            raise TypeError(f"pool: expected a deft KVPool, got {type(pool).__name__}")
        if (pool.num_layers, pool.num_kv_heads, pool.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"pool: expected layers/kv heads/head dim {c.num_layers}/{c.num_kv_heads}/{c.head_dim}, "
                f"got {pool.num_layers}/{pool.num_kv_heads}/{pool.head_dim}"
            )
        if pool.dtype != self.dtype and pool.dtype != attn.kv_dtype:
            raise TypeError(f"pool: expected dtype {self.dtype} (the model's) or the attention's "
                            f"planned kv_dtype, got {pool.dtype}")


def fuse_hf_weights(
    config: LlamaConfig, tensors: Mapping[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """Map Hugging Face Llama tensor names to :class:`LlamaModel`'s (fusing q/k/v and gate/up;
    ``self_attn.q_norm``/``k_norm`` where ``config.qk_norm``; with ``config.sandwich_norms``,
    Gemma's ``post_attention_layernorm`` normalises the attention output and
    ``pre_feedforward_layernorm``/``post_feedforward_layernorm`` the MLP's input and output).

    Raises ``ValueError`` naming ``source`` for a missing or unexpected tensor, or one whose
    shape does not follow from the config.
    """
    c, used = config, set()
    hidden, q_rows, kv_rows = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def take(name: str, rows: int, cols: int | None = None) -> torch.Tensor:
        """Tensor ``name``, checked to be ``[rows, cols]`` (a weight) or ``[rows]`` (a bias)."""
        if name not in tensors:
            raise ValueError(f"{source}: missing tensor {name!r}")
        t, shape = tensors[name], (rows,) if name.endswith(".bias") or cols is None else (rows, cols)
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape} from the config"
            )
        used.add(name)
        return t

    qkv_suffixes = ["weight"] + (["bias"] if c.attention_bias or c.qkv_bias else [])
    o_suffixes = ["weight"] + (["bias"] if c.attention_bias else [])
    mlp_suffixes = ["weight"] + (["bias"] if c.mlp_bias else [])
    state = {"embed.weight": take("model.embed_tokens.weight", c.vocab_size, hidden),
             "norm.weight": take("model.norm.weight", hidden)}
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight", c.vocab_size, hidden)
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        norms = ({"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
                 if c.sandwich_norms else
                 {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"})
        for norm, name in norms.items():
            state[ours + f"{norm}.weight"] = take(hf + f"{name}.weight", hidden)
        for s in qkv_suffixes:
            state[ours + f"qkv.{s}"] = torch.cat([
                take(hf + f"self_attn.{p}_proj.{s}", rows, hidden)
                for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
            ])
        for s in o_suffixes:
            state[ours + f"o.{s}"] = take(hf + f"self_attn.o_proj.{s}", hidden, q_rows)
        if c.qk_norm:
            for p in ("q", "k"):
                state[ours + f"{p}_norm.weight"] = take(hf + f"self_attn.{p}_norm.weight", c.head_dim)
        for s in mlp_suffixes:
            state[ours + f"gate_up.{s}"] = torch.cat([
                take(hf + f"mlp.{p}_proj.{s}", c.intermediate_size, hidden) for p in ("gate", "up")
            ])
            state[ours + f"down.{s}"] = take(hf + f"mlp.down_proj.{s}", hidden, c.intermediate_size)
    # Tied checkpoints may still carry lm_head; old ones carry the rotary inverse frequencies.
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(n for n in tensors if n not in used and n not in ignorable
                   and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
        raise ValueError(f"{source}: unexpected tensors {extra[:3]}{more} for a Llama model")
    return state


def build_model(
    config: LlamaConfig,
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaModel:
    """A :class:`LlamaModel` holding ``state`` (our names, e.g. from :func:`fuse_hf_weights`),
    in ``dtype`` on ``device``, ready for inference. No random initialisation is done.
    """
    with torch.device("meta"):
        model = LlamaModel(config)
    model.load_state_dict(
        {name: t.to(device=device, dtype=dtype) for name, t in state.items()}, strict=True, assign=True
    )
    model.rope = rope_table(config, dtype, device)
    if config.local_rope_layers:
        model.local_rope = rope_table(config, dtype, device, local=True)
    if config.nope_layers:
        model.nope_rope = identity_table(config, dtype, device)
    return model.requires_grad_(False).eval()
