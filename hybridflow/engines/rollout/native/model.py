"""A compact inference forward for HF Llama-family causal LMs (Llama, Qwen2) over the native KV cache.

It reads the HF module's own parameters (no copies, so in-place weight updates and a module shared with the
training engine are seen at once) and replaces only the per-call machinery that costs time in a decode loop:
no cache objects that grow by concatenation, no mask building, no repeated K/V heads. The math is the HF
modeling code's: RMSNorm in float32, rotary embeddings from the model's own `rotary_emb` (so every static
rope scaling type gives the same angles), `scaled_dot_product_attention` with the default 1/sqrt(head_dim) scale.

Two entry points:
- `prefill`: right-padded prompts, plain causal attention (padding sits after each prompt's real tokens, so
  no real query ever sees it); writes K/V into cache slots and returns the logits of each prompt's last token.
- `decode`: one token per active slot at per-slot positions; grouped-query heads are folded into the query
  length (q: (slots, kv_heads, group, head_dim)), so K/V are read straight from the cache views.

Multi-head latent attention (DeepSeek-V2/V3) runs in its absorbed form over a latent cache (`mla.py`).

Tensor parallel (`tp`, see `tensor_parallel.py`): the module holds this rank's shard of the heads, the MLP and the
vocabulary; the outputs of o_proj and down_proj are summed over the group, the embedding is looked up across it
and the logits are gathered from it, so every rank returns the same full logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.engines.rollout.native.kv_cache import KVCache
from hybridflow.engines.rollout.native.mla import MLAShape, MLAWeights, expand_values, latent_queries_and_keys
from hybridflow.engines.rollout.native.ops import rms_norm, rotate
from hybridflow.engines.rollout.native_support import NATIVE_ROPE_TYPES, native_unsupported_reason
from hybridflow.engines.rollout.tensor_parallel import RolloutTensorParallel
from hybridflow.models.parallel_plan import kv_heads_per_rank

logger = logging.getLogger(__name__)

_PRODUCT_WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down")
"""`LayerWeights` fields that the kernels multiply by (packed once per weight version)."""


@dataclass(frozen=True)
class LayerWeights:
    """References to one decoder layer's parameters (biases may be None). A mixture-of-experts layer has no dense
    MLP weights (`gate`, `up`, `down` are None) and keeps its HF block in `moe`, which routes and runs the experts.
    A multi-head latent attention layer has no `q`, `k`, `v` (None) and keeps its attention weights in `mla`."""

    input_norm: torch.Tensor
    q: torch.Tensor | None
    q_bias: torch.Tensor | None
    k: torch.Tensor | None
    k_bias: torch.Tensor | None
    v: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor | None
    gate_bias: torch.Tensor | None
    up: torch.Tensor | None
    up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    act: nn.Module | None
    moe: nn.Module | None = None
    q_norm: torch.Tensor | None = None
    """Qwen3's per-head RMSNorm weights (head_dim,) on queries and keys before RoPE; None in Llama/Qwen2."""
    k_norm: torch.Tensor | None = None
    mla: MLAWeights | None = None


class PackedWeights:
    """Copies of weights in the CPU kernels' packed layout (`pack_weight`), made once per weight version.

    An entry is reused while the parameter is the same object with the same storage and in-place version;
    `update_weights` (which copies through `.data`, not counted in the version) clears the whole cache via
    `LlamaFamilyForward.release`. Costs one more copy of the packed weights in memory.
    """

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        self._entries: dict[int, tuple[torch.Tensor, tuple[int, int], torch.Tensor]] = {}

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        stamp = (weight.data_ptr(), weight._version)
        entry = self._entries.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != stamp:
            entry = (weight, stamp, self.kernels.pack_weight(weight.detach()))
            self._entries[id(weight)] = entry  # holds `weight`, so its id is not reused while cached
        return entry[2]

    def clear(self) -> None:
        self._entries.clear()

    @property
    def num_bytes(self) -> int:
        return sum(packed.numel() * packed.element_size() for _, _, packed in self._entries.values())


def check_supported(model: nn.Module) -> None:
    """Raise ValueError if `model` is not a causal LM this forward reproduces exactly."""
    reason = native_unsupported_reason(model.config.to_dict())
    if reason is not None:
        raise ValueError(f"the native rollout cannot run this model: {reason}; use rollout name 'hf'")
    if any(hasattr(module, "lora_A") for module in model.modules()):
        raise ValueError(
            "the native rollout reads plain weights and would ignore LoRA adapters in this module; give it the "
            "merged weights (a plain model updated from `named_full_params()`, as the actor worker does) or use "
            "rollout name 'hf'"
        )
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in NATIVE_ROPE_TYPES:
        raise ValueError(
            f"the native rollout supports rope types {NATIVE_ROPE_TYPES}, got {rope_type!r}; use rollout name 'hf'"
        )


def is_moe_block(mlp: nn.Module) -> bool:
    """A decoder layer's MLP that routes over experts (an HF sparse-MoE block) rather than a dense gated MLP."""
    return not hasattr(mlp, "gate_proj") and hasattr(mlp, "experts")


def _run_moe_block(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The HF MoE block on normalised states h (..., hidden) -> (..., hidden): its own router (softmax, top-k,
    normalisation, shared experts) and experts, so routing matches the training engine's exactly."""
    out = block(h.reshape(1, -1, h.shape[-1]))
    out = out[0] if isinstance(out, tuple) else out  # some families also return the router logits
    return out.reshape(h.shape)


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for a few rows (a decode step), computed as (weight @ x^T)^T.

    Same product; MKL then splits the work over threads along the output features rather than the few rows,
    measured 10-15% faster per decode step on a 2-core CPU (docs/performance.md). The result is a transposed
    view, which is exactly the operand layout the next call wants. x: (rows, in) -> (rows, out).
    """
    out = torch.mm(weight, x.t()).t()
    return out if bias is None else out + bias


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of one query token per slot over that slot's cache; grouped query heads share K/V.

    Two batched matmuls over strided cache views: for 3 queries per KV head this beats the CPU flash kernel.
    q: (slots, kv_heads, group, head_dim), already scaled by 1/sqrt(head_dim); keys, values: (slots,
    kv_heads, span, head_dim); bias: (slots, 1, 1, span) 0 or -inf -> (slots, kv_heads, group, head_dim).
    """
    scores = torch.matmul(q, keys.transpose(-1, -2)).add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), values)


class LlamaFamilyForward:
    """Prefill and decode for one HF Llama-family model, reading its weights on every call."""

    def __init__(
        self, model: nn.Module, kernels: ModuleType | None = None, tp: RolloutTensorParallel | None = None
    ) -> None:
        """kernels: the compiled CPU decode kernels (`kernels.load_cpu_kernels`), or None for torch ops.
        tp: this rank's tensor-parallel group when `model` holds its shard (`build_sharded_causal_lm`)."""
        check_supported(model)
        self.kernels = kernels
        config = model.config
        self.model = model
        self.tp = tp if tp is not None and tp.size > 1 else None
        tp_size = self.tp.size if self.tp is not None else 1
        self.num_layers = config.num_hidden_layers
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp_size  # this rank's heads
        self.num_kv_heads = kv_heads_per_rank(config, tp_size)  # one replicated head when tp > kv heads
        self.mla = MLAShape.of(config, tp_size)
        self.latent_values: int | None = None
        """The cache's `latent_values` (MLA: values are the keys' latent features), else None."""
        if self.mla is not None:  # one cached key/value "head": the latent and the shared rotated key
            self.num_kv_heads, self.head_dim, self.latent_values = 1, self.mla.cache_dim, self.mla.kv_lora_rank
        self.group = self.num_heads // self.num_kv_heads
        self._silu = getattr(config, "hidden_act", None) == "silu"  # the kernels fuse silu(gate) * up
        if kernels is not None and self.mla is not None:
            logger.info("native rollout: multi-head latent attention decodes with torch ops (no CPU kernels)")
            self.kernels = None
        if kernels is not None and self.head_dim % 8:
            logger.warning("native rollout: head_dim %d is not a multiple of 8; decoding with torch ops", self.head_dim)
            self.kernels = None
        self.eps = config.rms_norm_eps
        self._cos = self._sin = None
        self._layers: list[LayerWeights] = []
        self._packed = PackedWeights(self.kernels) if self.kernels is not None else None
        self._packed_layers: list[dict[str, torch.Tensor]] = []

    # ------------------------------------------------------------------ weights and rope tables
    def bind(self, max_position: int) -> None:
        """Read the current parameter references and make rope tables for positions `[0, max_position)`.

        Called at the start of each generation, so replaced parameter objects are picked up too.
        """
        self._layers = [self._layer_weights(layer) for layer in self.model.model.layers]
        if self.kernels is not None and not self._kernel_ready_weights():
            logger.warning("native rollout: weights are not contiguous float32 CPU tensors; decoding with torch ops")
            self.kernels = self._packed = None
        if self._packed is not None:
            self._packed_layers = [
                {name: self._packed.get(getattr(w, name)) for name in _PRODUCT_WEIGHTS if getattr(w, name) is not None}
                for w in self._layers
            ]
            self._packed_head = self._packed.get(self.model.lm_head.weight)
        if self._cos is None or self._cos.shape[0] < max_position:
            rotary = self.model.model.rotary_emb
            weight = self.model.model.embed_tokens.weight
            positions = torch.arange(max_position, device=weight.device)[None]
            cos, sin = rotary(weight[:1], positions)
            self._cos, self._sin = cos[0], sin[0]  # (max_position, head_dim)

    def _kernel_ready_weights(self) -> bool:
        weights = [self.model.lm_head.weight] + [getattr(w, name) for w in self._layers for name in _PRODUCT_WEIGHTS]
        weights = [t for t in weights if t is not None]  # an MoE layer's experts run in its own block
        return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in weights)

    def operand_addresses(self) -> tuple[int, ...]:
        """Addresses of everything `decode` reads besides its arguments and the cache (rope tables, weights): a
        captured decode graph is valid while they are unchanged."""
        if self._cos is None:
            return ()
        model = self.model
        tensors = [self._cos, self._sin, model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight]
        tensors += [t for w in self._layers for t in vars(w).values() if isinstance(t, torch.Tensor)]
        tensors += [t for w in self._layers if w.moe is not None for t in w.moe.parameters()]
        tensors += [t for w in self._layers if w.mla is not None for t in w.mla.tensors()]
        return tuple(t.data_ptr() for t in tensors)

    def release(self) -> None:
        """Drop the rope tables and parameter references (rebuilt by `bind`)."""
        self._cos = self._sin = None
        self._layers = []
        self._packed_layers = []
        if self._packed is not None:
            self._packed.clear()

    @property
    def has_moe(self) -> bool:
        """Whether some layer routes over experts (the routing has data-dependent shapes: no decode graphs)."""
        return any(is_moe_block(layer.mlp) for layer in self.model.model.layers)

    def _layer_weights(self, layer: nn.Module) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        common = dict(
            input_norm=layer.input_layernorm.weight, o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
            post_norm=layer.post_attention_layernorm.weight,
        )
        if self.mla is not None:
            attention = dict(**common, q=None, q_bias=None, k=None, k_bias=None, v=None, v_bias=None,
                             mla=MLAWeights.of(attn, self.mla))
        else:
            attention = dict(
                **common, q=attn.q_proj.weight, q_bias=attn.q_proj.bias, k=attn.k_proj.weight, k_bias=attn.k_proj.bias,
                v=attn.v_proj.weight, v_bias=attn.v_proj.bias,
                q_norm=attn.q_norm.weight if hasattr(attn, "q_norm") else None,
                k_norm=attn.k_norm.weight if hasattr(attn, "k_norm") else None,
            )
        if is_moe_block(mlp):
            return LayerWeights(
                **attention, gate=None, gate_bias=None, up=None, up_bias=None, down=None, down_bias=None, act=None,
                moe=mlp,
            )
        return LayerWeights(
            **attention, gate=mlp.gate_proj.weight, gate_bias=mlp.gate_proj.bias, up=mlp.up_proj.weight,
            up_bias=mlp.up_proj.bias, down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias, act=mlp.act_fn,
        )

    # ------------------------------------------------------------------ shared pieces
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) int64 -> (..., hidden): a new tensor (safe to update in place)."""
        weight = self.model.model.embed_tokens.weight
        return weight[ids] if self.tp is None else self.tp.embed(weight, ids)

    def _rowwise(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, linear=F.linear) -> torch.Tensor:
        """A row-parallel product (o_proj, down_proj): this rank's input features times its weight columns, summed
        over the group; the (replicated) bias is added once, after the sum."""
        if self.tp is None:
            return linear(x, weight, bias)
        out = self.tp.all_reduce(linear(x, weight, None))
        return out if bias is None else out + bias

    def _mlp(self, x: torch.Tensor, w: LayerWeights, linear=F.linear) -> torch.Tensor:
        h = rms_norm(x, w.post_norm, self.eps)
        if w.moe is not None:
            return x + _run_moe_block(w.moe, h)
        gated = w.act(linear(h, w.gate, w.gate_bias)) * linear(h, w.up, w.up_bias)
        return x + self._rowwise(gated, w.down, w.down_bias, linear)

    def _qkv(
        self, x: torch.Tensor, w: LayerWeights, linear=F.linear
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (..., hidden) -> q (..., heads, head_dim), k and v (..., kv_heads, head_dim)."""
        h = rms_norm(x, w.input_norm, self.eps)
        q = linear(h, w.q, w.q_bias).unflatten(-1, (self.num_heads, self.head_dim))
        k = linear(h, w.k, w.k_bias).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = linear(h, w.v, w.v_bias).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if w.q_norm is not None:  # Qwen3: each head normalised before RoPE
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        return q, k, v

    def _latent_attention(
        self, q: torch.Tensor, keys: torch.Tensor, *, is_causal: bool = False, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """MLA's multi-query attention over latent keys: q (B, heads, L, rank + rope), already scaled; keys (B, 1, S,
        rank + rope), whose first kv_lora_rank features are the values -> (B, heads, L, rank)."""
        values = keys[..., : self.mla.kv_lora_rank]
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=is_causal, scale=1.0, enable_gqa=True
        )

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: (rows, hidden) -> float32 logits (rows, vocab)."""
        x = rms_norm(x, self.model.model.norm.weight, self.eps)
        head = self.model.lm_head
        return self._full_logits(F.linear(x, head.weight, head.bias).float())

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab // tp) this rank's slice -> (rows, vocab), the same on every rank of the group."""
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    # ------------------------------------------------------------------ entry points
    def prefill(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        last_index: torch.Tensor,
        cache: KVCache,
        start_slot: int,
        repeats: int,
    ) -> torch.Tensor:
        """Run right-padded prompts and store their K/V, each prompt in `repeats` consecutive slots.

        input_ids, position_ids: (num_prompts, prompt_len) int64, real tokens first in each row;
        last_index: (num_prompts,) index of each prompt's last real token -> float32 logits (num_prompts, vocab).
        """
        num_prompts, prompt_len = input_ids.shape
        x = self._embed(input_ids)
        cos, sin = self._cos[position_ids], self._sin[position_ids]  # (P, L, rope dims)
        if self.mla is not None:
            for index, w in enumerate(self._layers):
                q, entries = latent_queries_and_keys(rms_norm(x, w.input_norm, self.eps), w.mla, self.mla, cos, sin)
                keys = entries.unsqueeze(1)  # (P, 1, L, rank + rope): one key/value head
                cache.write_prompts(index, start_slot, keys, None, repeats)
                attn = self._latent_attention(q.transpose(1, 2), keys, is_causal=True)  # (P, heads, L, rank)
                attn = expand_values(attn.transpose(1, 2), w.mla)
                x = self._mlp(x + self._rowwise(attn, w.o, w.o_bias), w)
        else:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over the heads
            for index, w in enumerate(self._layers):
                q, k, v = (t.transpose(1, 2) for t in self._qkv(x, w))  # (P, heads, L, head_dim)
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
                cache.write_prompts(index, start_slot, k, v, repeats)
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.group > 1)
                attn = attn.transpose(1, 2).reshape(num_prompts, prompt_len, -1)
                x = self._mlp(x + self._rowwise(attn, w.o, w.o_bias), w)
        rows = torch.arange(num_prompts, device=x.device)
        return self._logits(x[rows, last_index])

    def extend(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache, slot: int, start: int
    ) -> torch.Tensor:
        """Continue one sequence whose first `start` positions are already in cache slot `slot`.

        input_ids, position_ids: (length,) the next tokens and their rope positions; their K/V go to cache
        positions `[start, start + length)`, and each attends to the cached prefix and to itself causally.
        -> float32 logits of the last token (1, vocab). (The generation server's prefix reuse: a conversation's
        next turn sends only the tokens after the previous turn's cache.)
        """
        length = input_ids.numel()
        end = start + length
        device = input_ids.device
        x = self._embed(input_ids)[None]  # (1, length, hidden)
        cos, sin = self._cos[position_ids][None], self._sin[position_ids][None]  # (1, length, rope dims)
        mask = torch.arange(end, device=device)[None, :] <= (start + torch.arange(length, device=device))[:, None]
        if self.mla is not None:
            for index, w in enumerate(self._layers):
                q, entries = latent_queries_and_keys(rms_norm(x, w.input_norm, self.eps), w.mla, self.mla, cos, sin)
                cache.keys[index][slot, :, start:end] = entries
                keys = cache.keys[index][slot : slot + 1, :, :end]
                attn = self._latent_attention(q.transpose(1, 2), keys, mask=mask)  # (1, heads, length, rank)
                attn = expand_values(attn.transpose(1, 2), w.mla)
                x = self._mlp(x + self._rowwise(attn, w.o, w.o_bias), w)
        else:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over the heads
            for index, w in enumerate(self._layers):
                q, k, v = (t.transpose(1, 2) for t in self._qkv(x, w))  # (1, heads, length, head_dim)
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
                cache.keys[index][slot, :, start:end] = k[0]
                cache.values[index][slot, :, start:end] = v[0]
                keys = cache.keys[index][slot : slot + 1, :, :end]
                values = cache.values[index][slot : slot + 1, :, :end]
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.group > 1)
                attn = attn.transpose(1, 2).reshape(1, length, -1)
                x = self._mlp(x + self._rowwise(attn, w.o, w.o_bias), w)
        return self._logits(x[:, -1])

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, span: int, cache: KVCache
    ) -> torch.Tensor:
        """One decode step for the active slots `[0, num_active)`.

        tokens: (num_active,) the last sampled tokens; positions: (num_active,) their rope positions;
        lengths: (num_active,) tokens already cached per slot (the new token goes at that cache position);
        span: 1 + max(lengths), the attention width -> float32 logits (num_active, vocab).
        """
        if self.kernels is not None:  # set only for float32 CPU weights (checked in `__init__` and `bind`)
            return self._decode_with_kernels(tokens, positions, lengths, cache)
        num_active = tokens.numel()
        index = cache.decode_index(lengths)
        visible = torch.arange(span, device=tokens.device)[None, :] <= lengths[:, None]
        bias = torch.zeros(visible.shape, dtype=cache.dtype, device=tokens.device).masked_fill_(~visible, -torch.inf)
        bias = bias[:, None, None, :]
        cos, sin = self._cos[positions], self._sin[positions]  # (A, rope dims)
        x = self._embed(tokens)
        if self.mla is not None:
            for layer, w in enumerate(self._layers):
                q, entries = latent_queries_and_keys(rms_norm(x, w.input_norm, self.eps), w.mla, self.mla, cos, sin)
                cache.append(layer, index, entries[:, None], None)
                keys, values = cache.active(layer, num_active, span)  # values: the keys' latent features
                attn = expand_values(_decode_attention(q[:, None], keys, values, bias)[:, 0], w.mla)
                x = self._mlp(x + self._rowwise(attn, w.o, w.o_bias, _linear_rows), w, _linear_rows)
            return self._logits(x)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (A, 1, head_dim)
        scale = self.head_dim**-0.5  # folded into the query rotation
        q_cos, q_sin = cos * scale, sin * scale
        for layer, w in enumerate(self._layers):
            q, k, v = self._qkv(x, w, _linear_rows)
            q, k = rotate(q, q_cos, q_sin), rotate(k, cos, sin)
            cache.append(layer, index, k, v)
            keys, values = cache.active(layer, num_active, span)
            q = q.reshape(num_active, self.num_kv_heads, self.group, self.head_dim)
            attn = _decode_attention(q, keys, values, bias).reshape(num_active, -1)
            x = self._mlp(x + self._rowwise(attn, w.o, w.o_bias, _linear_rows), w, _linear_rows)
        return self._logits(x)

    def _decode_with_kernels(
        self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """`decode` with the compiled CPU kernels: the same math, one kernel per step of a layer, the residual
        stream updated in place, attention over each slot's own length (no mask, no span)."""
        kern, rows, eps = self.kernels, tokens.numel(), self.eps
        cos, sin = self._cos[positions], self._sin[positions]  # (rows, head_dim)
        visible = lengths + 1  # the new token is stored at position `lengths`
        x = self._embed(tokens)  # a new tensor: safe to update in place
        for layer, (w, packed) in enumerate(zip(self._layers, self._packed_layers)):
            h = kern.rms_norm(x, w.input_norm, eps)
            q = kern.linear_rows(h, packed["q"], w.q.shape[0], w.q_bias).view(rows, self.num_heads, self.head_dim)
            k = kern.linear_rows(h, packed["k"], w.k.shape[0], w.k_bias).view(rows, self.num_kv_heads, self.head_dim)
            v = kern.linear_rows(h, packed["v"], w.v.shape[0], w.v_bias).view(rows, self.num_kv_heads, self.head_dim)
            if w.q_norm is not None:  # Qwen3: each head normalised before RoPE
                q = kern.rms_norm(q.view(-1, self.head_dim), w.q_norm, eps).view(rows, self.num_heads, self.head_dim)
                k = kern.rms_norm(k.view(-1, self.head_dim), w.k_norm, eps).view(rows, self.num_kv_heads, self.head_dim)
            kern.rotate_(q, cos, sin, self.head_dim**-0.5)  # the attention scale folded into the query
            kern.rotate_(k, cos, sin, 1.0)
            kern.append_kv(k, v, cache.keys[layer], cache.values[layer], lengths)
            q = q.view(rows, self.num_kv_heads, self.group, self.head_dim)
            attn = kern.decode_attention(q, cache.keys[layer], cache.values[layer], visible)
            self._rowwise_add_(x, attn.view(rows, -1), packed["o"], w.o_bias)
            h = kern.rms_norm(x, w.post_norm, eps)
            if w.moe is not None:  # the HF block routes and runs the experts (torch ops)
                x.add_(_run_moe_block(w.moe, h))
                continue
            gate = kern.linear_rows(h, packed["gate"], w.gate.shape[0], w.gate_bias)
            up = kern.linear_rows(h, packed["up"], w.up.shape[0], w.up_bias)
            if self._silu:
                kern.silu_mul_(gate, up)
            else:
                gate = (w.act(gate) * up).contiguous()
            self._rowwise_add_(x, gate, packed["down"], w.down_bias)
        head = self.model.lm_head
        h = kern.rms_norm(x, self.model.model.norm.weight, eps)
        return self._full_logits(kern.linear_rows(h, self._packed_head, head.weight.shape[0], head.bias))

    def _rowwise_add_(
        self, residual: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        """`residual += x @ weight^T + bias` with the kernels; under tensor parallelism the products of the group's
        ranks are summed first (`_rowwise`)."""
        if self.tp is None:
            self.kernels.linear_rows_add_(residual, x, packed, bias)
            return
        out = self.tp.all_reduce(self.kernels.linear_rows(x, packed, residual.shape[1], None))
        residual.add_(out if bias is None else out + bias)
