"""Llama-family forward pass in plain PyTorch over a paged KV cache, runnable one layer range at a time."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.kv.cache import KVCache
from kvflow.model import cpu_kernels, decode_fusion, prompt_attention
from kvflow.model.batch import ForwardBatch
from kvflow.model.config import ModelConfig
from kvflow.model.linear import Linear, choose_small_paths

# Called right after layer `layer`'s K and V for this step are written into the cache.
LayerHook = Callable[[int, ForwardBatch], None]

ROPE_BLOCK = 256  # positions per block of the RoPE table (`LlamaModel._rope`)


@dataclass
class LayerWeights:
    """One decoder layer: norms as tensors, projections as prepared `Linear`s."""

    input_norm: torch.Tensor  # [D]
    qkv: Linear  # [q + 2 kv, D]
    o: Linear  # [D, q]
    post_norm: torch.Tensor  # [D]
    gate_up: Linear  # [2 I, D]
    down: Linear  # [D, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm. In float32 ATen's fused kernel computes the same (one pass instead
    of six elementwise ops: pow, mean, add, rsqrt and two multiplies); other dtypes keep transformers'
    order (normalise in float32, cast, then scale) to stay as close to it as they are."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _triton(kind: str):
    """`kvflow.model.triton_<kind>` (Triton's kernels: "attention", "fused", "fused_linear"), imported on
    first use: Triton's import is slow and only CUDA uses it."""
    return importlib.import_module(f"kvflow.model.triton_{kind}")


class LlamaModel:
    """Layers [layer_start, layer_end) of a Llama model; the first stage embeds, the last computes logits.

    Contract: `embed(ids) -> hidden [T, D]`; `run_layers(hidden, batch, kv, hook) -> hidden` runs every
    held layer, writing each layer's new K/V at `batch.slot_mapping` before attending, then calling
    `hook(layer, batch)`; `logits(hidden, batch) -> [num_seqs, vocab]` for each sequence's last token.
    Running stage [0, k) then [k, L) on the hidden states equals running [0, L) at once.

    `deterministic=True` (the default here; engines and pipeline workers build with
    `EngineConfig.deterministic`, off by default) makes the forward batch-invariant where the CPU kernels run (`batch_invariant`): a token's hidden states, K/V and logits are bitwise the same whatever else
    shares its step, wherever it sits, and whether it is decoded, computed in a prompt chunk of any
    length or recomputed (projections by `cpu_kernels.invariant_linear` for every row count, decode
    rows attended by the prefill kernel, RoPE from a per-position table, per-row norms); on CUDA, where
    the Triton kernels run (`triton_attention`, and `triton_invariant`'s projection and RMS norm). False
    takes the fastest path per row count instead (`choose_small_paths`, oneDNN, the decode kernel; cuBLAS,
    and on CUDA the norms and SiLU inside the projections of decode steps where that measured faster: `decode_fusion`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[LayerWeights],
        layer_range: tuple[int, int],
        embed: torch.Tensor | None,
        norm: torch.Tensor | None,
        lm_head: torch.Tensor | None,
        deterministic: bool = True,
    ) -> None:
        self.cfg = cfg
        self.deterministic = deterministic
        self.layer_start, self.layer_end = layer_range
        assert len(layers) == self.layer_end - self.layer_start
        self.layers = layers
        self.embed_tokens = embed
        self.norm = norm
        self.lm_head = lm_head
        self._lm_head = Linear(lm_head, deterministic) if lm_head is not None else None
        if not deterministic:
            linears = [lin for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down)] + [self._lm_head] * (lm_head is not None)
            small = choose_small_paths(linears)
            for lin in linears:
                lin.small = dict(small)
                if "fixed" not in small.values():  # the invariant kernel's copy of the weight, unused
                    lin.invariant = None
        self.scale = cfg.head_dim**-0.5
        self._group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        device = layers[0].input_norm.device
        # On CPU with a C++ compiler the layer's elementwise passes run as fused kernels (`cpu_kernels`) and
        # attention (decode rows and prompt chunks) reads K/V in place; otherwise the PyTorch path (see
        # `_decode_attention` and `_attention`).
        self.cpu_kernels = cpu_kernels.available(device)
        self.paged_kernel = self.cpu_kernels and cpu_kernels.paged_attention_supported(
            cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
        # On CUDA with Triton, attention reads K/V in place too (`triton_attention`, batch-invariant by
        # construction); the projections there are cuBLAS's, which are not.
        self.triton_attention = device.type == "cuda" and _triton("attention").available(device)
        # The layer's elementwise passes (norms, RoPE + K/V write, SiLU) as fused kernels, one row per
        # program: `cpu_kernels` on CPU, `triton_fused` on CUDA; None runs them op by op in PyTorch.
        self.fused_ops = cpu_kernels if self.cpu_kernels else _triton("fused") if self.triton_attention else None
        # Not deterministic, on CUDA: decode steps of the row counts measured faster so take the norms and
        # SiLU inside the projections they feed (`decode_fusion`, `triton_fused_linear`).
        self.fusion = (decode_fusion.choose(layers, cfg.rms_norm_eps) if self.triton_attention and not deterministic
                       else decode_fusion.FusionChoice(why="off: not on CUDA, or deterministic"))
        # A step of decode rows only runs its layers in one native call (`cpu_kernels.decode_layers`:
        # the same kernels and projections, bitwise the same result, no Python call per op); False
        # runs them op by op from Python (for comparison; hooks and prompt chunks always do).
        self.native_decode = self.paged_kernel
        projections = [lin for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down)]
        # Batch-invariant: every projection on the invariant kernel and attention on the paged kernels
        # (decode rows through the prefill kernel); else the fast paths.
        self.batch_invariant = (self.paged_kernel and all(lin.batch_invariant for lin in projections)) or (
            self.triton_attention and all(lin.triton for lin in projections))  # (on CUDA: the Triton kernels)
        # Fast path only: prompt chunks from lengths measured at load go to the AMX kernel, all in one
        # call (`amx_from`), or to PyTorch's flash attention one at a time (`sdpa_from`).
        self.amx_from, self.sdpa_from = (prompt_attention.choose_prompt_paths(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layers[0].input_norm.dtype)
            if self.paged_kernel and not self.batch_invariant else (None, None))
        # Not batch-invariant on CUDA: decode rows through the split-context kernel, if it runs here.
        self.split_decode = (self.triton_attention and not self.batch_invariant
                             and _triton("attention").split_decode_works(device))
        prepared = [lin.invariant if self.batch_invariant else lin.packed for lin in projections]
        none = [lin.weight.new_empty(0) for lin in projections]
        self._decode_weights = (
            [w.input_norm for w in layers],
            [w.post_norm for w in layers],
            [lin.weight for lin in projections],
            [p if p is not None else e for p, e in zip(prepared, none)],
        )
        # the "fixed" path's weights (invariant_linear's packing), where a row count chose it
        self._fixed_weights = [lin.invariant if lin.invariant is not None else e for lin, e in zip(projections, none)]
        if cfg.rope_scaling.kind == "default":  # the same float32 arithmetic as transformers
            exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float().to(device) / cfg.head_dim
            self.inv_freq = 1.0 / (cfg.rope_theta**exponent)
        else:
            inv = cfg.rope_scaling.inv_freq(cfg.head_dim, cfg.rope_theta)
            self.inv_freq = torch.tensor(inv, dtype=torch.float32, device=device)
        self._cos = self._sin = torch.empty(0, cfg.head_dim, dtype=layers[0].input_norm.dtype, device=device)
        self.rope_positions = cfg.max_position_embeddings  # once the table holds this many, it is not grown or checked

    def reserve_rope(self, num_positions: int) -> None:
        """Build the RoPE table for positions [0, num_positions) now; the caller promises no position
        beyond (a step that must not synchronise with the host, such as a CUDA graph's, relies on it)."""
        self.rope_positions = min(self.rope_positions, num_positions)
        self._rope(torch.tensor([num_positions - 1], device=self.inv_freq.device))

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        sd: Mapping[str, torch.Tensor],
        layer_range: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        deterministic: bool = True,
    ) -> "LlamaModel":
        """Build from Hugging Face Llama parameter names (`model.layers.N.self_attn.q_proj.weight`, ...);
        `deterministic`: batch-invariant (see the class)."""
        start, end = layer_range or (0, cfg.num_layers)
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside the model's {cfg.num_layers} layers")

        def get(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"checkpoint lacks tensor {name!r}")
            return sd[name].to(device=device, dtype=dtype)

        def proj(*names: str) -> Linear:  # HF [out, in] matrices, stacked on out
            return Linear(torch.cat([get(n) for n in names]), deterministic)

        layers = []
        for i in range(start, end):
            p = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    input_norm=get(p + "input_layernorm.weight"),
                    qkv=proj(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                    o=proj(p + "self_attn.o_proj.weight"),
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=proj(p + "mlp.down_proj.weight"),
                )
            )
        last = end == cfg.num_layers
        embed = get("model.embed_tokens.weight") if start == 0 or (last and cfg.tie_word_embeddings) else None
        norm = lm_head = None
        if last:
            norm = get("model.norm.weight")
            lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
        return cls(cfg, layers, (start, end), embed if start == 0 else None, norm, lm_head, deterministic)

    @staticmethod
    def tensor_filter(cfg: ModelConfig, layer_range: tuple[int, int]):
        """Which checkpoint tensors `from_state_dict` needs for a stage holding `layer_range`."""
        start, end = layer_range
        last = end == cfg.num_layers

        def want(name: str) -> bool:
            if name.startswith("model.layers."):
                return start <= int(name.split(".")[2]) < end
            if name == "model.embed_tokens.weight":
                return start == 0 or (last and cfg.tie_word_embeddings)
            return last  # model.norm, lm_head

        return want

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.cfg.num_layers

    @property
    def kernel_variant(self) -> str:
        """What decides the bits of a row's result, the same string on every process that computes
        them alike: "batch-invariant <dtype> linear=<invariant_linear_isa> vec=<vector width>
        cpu=<torch's CPU capability>" (on CUDA: "batch-invariant <dtype> triton cuda=<device name>") when
        `batch_invariant` (two such processes give a request the
        same tokens whichever of them runs which of its steps), else "per-shape <dtype>" (paths
        chosen per row count, measured in each process: no bitwise promise across processes).
        Pipeline stages report it at start-up; the controller refuses stages that disagree."""
        dtype = str(self.layers[0].input_norm.dtype).removeprefix("torch.")
        if not self.batch_invariant:
            return f"per-shape {dtype}"
        if self.triton_attention:
            return f"batch-invariant {dtype} triton cuda={torch.cuda.get_device_name(self.inv_freq.device)}"
        isa = cpu_kernels.invariant_linear_isa(self.layers[0].input_norm.dtype)
        return (f"batch-invariant {dtype} linear={isa} vec={cpu_kernels.vec_size()} "
                f"cpu={torch.backends.cpu.get_cpu_capability()}")

    @property
    def weight_bytes(self) -> int:
        seen: dict[int, int] = {}  # the bytes one step reads (a prepacked copy is read instead, not as well)
        tensors = [t.weight if isinstance(t, Linear) else t for lw in self.layers for t in vars(lw).values()]
        for t in tensors + [self.embed_tokens, self.norm, self.lm_head]:
            if t is not None:
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    # ----------------------------------------------------------------- forward
    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("this stage does not hold the embedding (it is not the first stage)")
        return F.embedding(token_ids, self.embed_tokens)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, batch: ForwardBatch, as_float: bool = True) -> torch.Tensor:
        """Each sequence's last-token logits, in float32 or (`as_float=False`) the model's dtype, which
        holds the same values: the LM head computes in it (a worker sends half the bytes)."""
        if self.lm_head is None or self.norm is None:
            raise RuntimeError("this stage does not hold the LM head (it is not the last stage)")
        h = self._norm(hidden.index_select(0, batch.logits_idx), self.norm)
        out = self._lm_head(h)
        return out.float() if as_float else out

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, kv: KVCache, hook: LayerHook | None = None) -> torch.Tensor:
        """All layers, for a model holding the whole range: token ids [T] -> last-token logits [num_seqs, V]."""
        return self.logits(self.run_layers(self.embed(token_ids), batch, kv, hook), batch)

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor, batch: ForwardBatch, kv: KVCache, hook: LayerHook | None = None) -> torch.Tensor:
        if hidden.shape != (batch.num_tokens, self.cfg.hidden_size):
            raise ValueError(f"hidden states {tuple(hidden.shape)} do not match the batch ({batch.num_tokens} tokens)")
        cos, sin = self._rope(batch.positions)
        if hook is None and self._native_decode_ok(hidden, batch, kv):
            path = self.layers[0].qkv.path(hidden.shape[0])
            norms_in, norms_post, weights, packed = self._decode_weights
            x, delta = cpu_kernels.decode_layers(
                hidden, norms_in, norms_post, weights, self._fixed_weights if path == "fixed" else packed,
                cpu_kernels.DECODE_PATHS.index(path),
                [kv.layer_kv(layer) for layer in range(self.layer_start, self.layer_end)], cos, sin, batch.slot_mapping,
                batch.decode_block_table, batch.decode_context_lens, self.cfg.rms_norm_eps, self.scale,
                self.cfg.num_heads, self.cfg.num_kv_heads, self.batch_invariant,
            )
            return x + delta
        delta = None  # the last layer's MLP output, added to `hidden` by the next layer's norm
        for i, lw in enumerate(self.layers):
            layer = self.layer_start + i
            hidden, delta = self._layer(layer, lw, hidden, delta, batch, kv, cos, sin, hook)
        return hidden + delta

    def _native_decode_ok(self, hidden: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> bool:
        """Whether `cpu_kernels.decode_layers` runs this step: decode rows only (in order), the paged
        kernel on (it is what the native loop calls), and the fused kernels take the tensors (one
        dtype, contiguous), as `_layer`'s fused path requires."""
        return (self.native_decode and self.paged_kernel and not batch.prefill and batch.decode_rows.numel() > 0
                and hidden.dtype == kv.data.dtype == self.layers[0].input_norm.dtype and hidden.is_contiguous())

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of each token's position, in the model's dtype, from a table grown
        in blocks of `ROPE_BLOCK` positions. Every block is computed by the same ops on a tensor of the
        same shape, so a position's values never depend on the step it is in (computed per step,
        ATen's vectorised cos/sin left a tail of a step's elements to its scalar loop: values that
        differed in the last bit by batch size)."""
        if self._cos.shape[0] >= self.rope_positions:  # (no host sync: a captured CUDA graph allows none)
            return self._cos.index_select(0, positions), self._sin.index_select(0, positions)
        need = int(positions.max()) + 1 if positions.numel() else 0
        while self._cos.shape[0] < need:
            pos = torch.arange(self._cos.shape[0], self._cos.shape[0] + ROPE_BLOCK, device=self.inv_freq.device)
            freqs = pos.float()[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = torch.cat((self._cos, emb.cos().to(self._cos.dtype)))
            self._sin = torch.cat((self._sin, emb.sin().to(self._sin.dtype)))
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def _fused(self, *tensors: torch.Tensor) -> bool:
        """Whether the fused kernels take these tensors (there are some, contiguous, one dtype)."""
        return self.fused_ops is not None and all(t.is_contiguous() and t.dtype == tensors[0].dtype for t in tensors)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fused(x, weight):
            return self.fused_ops.rms_norm(x, weight, self.cfg.rms_norm_eps)
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)); `delta` (a projection's fresh output) may be overwritten by the sum."""
        if delta is None:
            return x, self._norm(x, weight)
        if self._fused(delta, x, weight):
            return delta, self.fused_ops.add_rms_norm(delta, x, weight, self.cfg.rms_norm_eps)
        x = x + delta
        return x, rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _layer(self, layer, lw: LayerWeights, x, delta, batch: ForwardBatch, kv: KVCache, cos, sin, hook):
        """One decoder layer on x + delta -> (residual stream, MLP output still to be added to it)."""
        cfg, T = self.cfg, x.shape[0]
        fuse = not batch.prefill and self.fusion.takes(T) and self._fused(x, lw.input_norm)  # (decode rows: `decode_fusion`)
        x, qkv = self._norm_linear(x, delta, lw.input_norm, lw.qkv, fuse)
        kv_layer = kv.layer_kv(layer)
        if self._fused(qkv, cos, sin, kv_layer):  # RoPE in place and the K/V write, one pass
            self.fused_ops.rope_write(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, kv_layer, batch.slot_mapping)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(T, cfg.num_heads, cfg.head_dim)
            k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        else:
            # RoPE on the query and key heads together (one set of elementwise passes, not one per tensor)
            qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
            qk = qk.view(T, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            qk = torch.addcmul(qk * cos[:, None, :], rotate_half(qk), sin[:, None, :])
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            kv.write(layer, batch.slot_mapping, k, v.view(T, cfg.num_kv_heads, cfg.head_dim))
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        if hook is not None:
            hook(layer, batch)
        attn = self._attention(layer, q, k, v, batch, kv)
        x, gate_up = self._norm_linear(x, lw.o(attn.reshape(T, cfg.q_size)), lw.post_norm, lw.gate_up, fuse)
        if fuse:
            return x, _triton("fused_linear").silu_linear(gate_up, lw.down.weight)
        if self._fused(gate_up):
            return x, lw.down(self.fused_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return x, lw.down(F.silu(gate) * up)

    def _norm_linear(self, x, delta, norm: torch.Tensor, lin: Linear, fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, lin(rms_norm(x + delta))): in one kernel where `fuse`, else the norm then the projection."""
        if fuse:
            return _triton("fused_linear").add_norm_linear(x, delta, norm, lin.weight, self.cfg.rms_norm_eps)
        x, h = self._add_norm(x, delta, norm)
        return x, lin(h)

    def _decode_attention(self, layer: int, qd: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """One query token per decode sequence [Bd, H, hd] over its cached context -> [Bd, H, hd]."""
        if self.paged_kernel:
            return cpu_kernels.paged_decode_attention(
                qd, kv.layer_kv(layer), batch.decode_block_table, batch.decode_context_lens, self.scale,
                self.batch_invariant,
            )
        # Fallback (non-CPU devices, no compiler): K and V of every decode sequence in one gather,
        # [2, Bd, S, kvh, hd] -> [2, Bd, kvh, S, hd]; queries grouped per KV head: [Bd, kvh, g, hd].
        cfg = self.cfg
        bd = qd.shape[0]
        both = kv.layer_kv(layer).index_select(1, batch.decode_block_table.flatten())
        both = both.view(2, bd, -1, cfg.num_kv_heads, cfg.head_dim).transpose(2, 3)
        keys, vals = both[0], both[1]
        qd = qd.reshape(bd, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
        scores = torch.matmul(qd, keys.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~batch.decode_key_mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(qd.dtype)
        return torch.matmul(probs, vals).reshape(bd, cfg.num_heads, cfg.head_dim)

    def _attention(self, layer: int, q, k, v, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        if self.triton_attention:
            return self._triton_attention(layer, q, batch, kv)
        if not batch.prefill and batch.decode_rows.numel():  # all rows decode, in order: no row gather/scatter
            return self._decode_attention(layer, q, batch, kv)
        # Prompt chunks: the paged kernel, all in one call, K/V read in place from the cache; on the fast
        # path those of `amx_from` tokens or more the AMX kernel's (one call, in place too), those of
        # `sdpa_from` or more SDPA one chunk at a time (as all chunks without the paged kernel).
        amx, long, rest = batch.prompt_bands(self.amx_from, self.sdpa_from if self.paged_kernel else 2)
        out = (cpu_kernels.paged_prefill_attention(q, kv.layer_kv(layer), *rest, self.scale) if rest is not None
               else torch.empty(q.shape, dtype=q.dtype, device=q.device))
        if amx is not None:
            cpu_kernels.paged_prefill_attention_fast(q, kv.layer_kv(layer), *amx, self.scale, out)
        for i in long:
            self._sdpa_chunk(layer, q, k, v, batch.prefill[i], kv, out)
        if batch.decode_rows.numel():
            qd = q.index_select(0, batch.decode_rows)
            out.index_copy_(0, batch.decode_rows, self._decode_attention(layer, qd, batch, kv))
        return out

    def _triton_attention(self, layer: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Prompt chunks in one kernel call, decode rows in another: the same kernel and tile sizes when
        batch-invariant, else the split decode kernel (`paged_decode`)."""
        out, kv_layer = torch.empty(q.shape, dtype=q.dtype, device=q.device), kv.layer_kv(layer)
        if batch.prefill:
            _triton("attention").paged_attention(q, kv_layer, batch.prefill_block_table, batch.prefill_query_start,
                                                batch.prefill_query_len, batch.prefill_context_lens,
                                                max(s.query_len for s in batch.prefill), self.scale, out)
        if batch.decode_rows.numel() and not self.split_decode:
            _triton("attention").paged_attention(q, kv_layer, batch.decode_block_table, batch.decode_rows,
                                                batch.decode_query_len, batch.decode_context_lens, 1, self.scale, out)
        elif batch.decode_rows.numel():  # (fast path: contexts split across programs at small batches)
            _triton("attention").paged_decode(q, kv_layer, batch.decode_block_table, batch.decode_rows,
                                             batch.decode_context_lens, self.scale, out)
        return out

    def _sdpa_chunk(self, layer: int, q, k, v, s, kv: KVCache, out: torch.Tensor) -> None:
        """One prompt chunk through SDPA into its rows of `out`: a whole prompt over its fresh K/V, a
        chunk after cached context over its sequence's K/V gathered from the cache."""
        rows = slice(s.query_start, s.query_start + s.query_len)
        past = None if s.context_len == s.query_len else kv.read(layer, list(s.block_ids), s.context_len)
        out[rows] = prompt_attention.attend_chunk(q[rows], k[rows], v[rows], s, self.scale, self._group, past)
