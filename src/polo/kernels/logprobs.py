"""Per-token log-probs and entropy from the lm_head without materialising the full logits, on any device.

For a completion token y_t with trunk hidden state h_t (d,) and output matrix W (V, d),

    z_t = W h_t                      logits, (V,)
    log π(y_t) = z_t[y_t]/T − logsumexp(z_t/T)
    H_t = logsumexp(z_t/T) − Σ_v p_v z_t[v]/T,    p = softmax(z_t/T)

The naive route builds the (tokens, V) logits tensor in float32 and keeps it (plus the
log-softmax temporaries) alive for backward: gigabytes for V ≈ 50k. Here the logits are
computed in tiles of (tokens, vocabulary block); only one tile exists at a time, the softmax
statistics are merged across blocks online, and backward takes each tile's logits again, kept from
the forward on a CPU when they fit `KEPT_LOGITS_BYTES`, else recomputed from the saved hidden states,
with the per-token logsumexp:

    ∂ log π(y_t) / ∂z_t = (onehot(y_t) − p_t) / T          ∂H_t / ∂z_t = −p_t ⊙ (log p_t + H_t) / T
    ∂L/∂h_t = g_t (onehot(y_t) − p_t)/T · W          ∂L/∂W = Σ_t g_t ((onehot(y_t) − p_t)/T)ᵀ h_t

`completion_logprobs_fused` applies this to a Hugging Face causal LM by running the trunk
(`model.get_decoder()`) and using the output embedding matrix directly; it is only valid for
models whose logits are exactly `lm_head(last_hidden_state)`. `supports_fused_logprobs` decides
that from what the model is, whatever its family is called: a bias-free linear head, and one traced
forward showing that the head reads the trunk's output (after its final norm) and that nothing
changes its logits afterwards.

Plain torch on the tensors' own device (tiles, buffers and statistics are allocated where
`hidden` lives), so the CPU and CUDA run the same code; only the tile sizes were tuned on the CPU.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from torch.autograd.function import once_differentiable

from polo.kernels.cpu.linear import onednn_fp32_pays, onednn_linear

__all__ = [
    "ChunkedTokenLogprobs",
    "LogprobSettings",
    "head_reads_trunk",
    "completion_logprobs_fused",
    "supports_fused_logprobs",
    "token_logprobs",
]

# Config fields that mean the logits are post-processed after lm_head (soft-capping, scaling).
# Checked on the config and on its `text_config`, whatever the model type.
LOGIT_POSTPROCESSING_FIELDS = (
    "final_logit_softcapping",  # gemma2/3/4, vaultgemma, nanochat, t5gemma
    "logit_softcapping",
    "output_logit_soft_cap",  # xlstm
    "logit_scale",  # cohere, cohere2
    "logits_scaling",  # granite*, hyperclovax, minicpm3
    "output_multiplier",
    "lm_head_multiplier",  # falcon_h1
    "dim_model_base",  # minicpm (hidden states scaled before lm_head)
)


def _accumulation_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Return the dtype softmax statistics are taken in: float32, or float64 for float64 inputs."""
    return torch.promote_types(compute_dtype, torch.float32)


VOCAB_BLOCK = 4096  # vocabulary columns per tile; with 1024-token chunks a float32 tile is 16 MiB

# On a CPU the forward keeps its logits (in the matmul's dtype) for backward when they take at most
# this much memory, instead of backward recomputing them: a third of the head's matmul work. The
# bench's update (1,844 completion tokens x 49,152 words, bf16) keeps 173 MiB and saves 24 matmuls of
# (1,024 x 576 x 4,096). A GPU recomputes: its matmuls are cheap and its memory is not.
KEPT_LOGITS_BYTES = 512 * 2**20


@dataclass(frozen=True)
class LogprobSettings:
    """What the tiled lm_head pass computes and how: log-probs at `temperature`, the entropy too when
    `with_entropy`, in tiles of `chunk_size` tokens x `vocab_block` words, the logits matmul in `compute_dtype`
    (None: bf16 under bf16 autocast on the hidden states' device, else their own dtype); with `keep_logits`, the
    forward keeps its logits for backward where they fit (`KEPT_LOGITS_BYTES`, on a CPU)."""

    temperature: float = 1.0
    with_entropy: bool = False
    chunk_size: int = 1024
    vocab_block: int = VOCAB_BLOCK
    compute_dtype: torch.dtype | None = None
    keep_logits: bool = True


def _tile_buffers(rows: int, cols: int, compute_dtype: torch.dtype, acc_dtype: torch.dtype, device) -> tuple:
    """Return flat scratch buffers for one (rows, cols) tile: logits in compute_dtype (None when it is acc_dtype), and
    two in acc_dtype.

    Reused for every tile of a call (as views of the front of each buffer), so the loop does not
    allocate: fresh large tensors on the CPU cost a page fault per 4 KiB, which had dominated
    this function's time.
    """
    size = rows * cols
    raw = torch.empty(size, dtype=compute_dtype, device=device) if compute_dtype != acc_dtype else None
    return raw, torch.empty(size, dtype=acc_dtype, device=device), torch.empty(size, dtype=acc_dtype, device=device)


def _through_onednn(device: torch.device, compute_dtype: torch.dtype) -> bool:
    """Return whether the tiles' fp32 matmuls go through oneDNN: on a CPU that measured it faster than torch's fp32
    matmul (`polo.kernels.cpu.linear.onednn_fp32_pays`; there, 2.1x the rate at these shapes)."""
    return device.type == "cpu" and compute_dtype == torch.float32 and onednn_fp32_pays()


def _tile_logits(
    h: torch.Tensor, w_block: torch.Tensor, buffers: tuple, inv_t: float, onednn: bool, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Return z/T for one tile, (rows, cols) in the accumulation dtype, written into the tile buffers (a fresh tensor
    from oneDNN with `onednn`, which has no output argument).

    `keep` (rows, cols) in the matmul's dtype, when given, receives the matmul's output z (before /T) for backward
    (`_kept_tile_logits` turns it back into this function's result).
    """
    if keep is not None:
        if onednn:
            keep.copy_(onednn_linear(h, w_block))
        else:
            torch.mm(h, w_block.T, out=keep)
        return _kept_tile_logits(keep, buffers, inv_t)
    raw, z_buffer, _ = buffers
    rows, cols = h.shape[0], w_block.shape[0]
    z = z_buffer[: rows * cols].view(rows, cols)
    if onednn:
        z = onednn_linear(h, w_block)
    elif raw is None:
        torch.mm(h, w_block.T, out=z)
    else:
        z.copy_(torch.mm(h, w_block.T, out=raw[: rows * cols].view(rows, cols)))
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def _kept_tile_logits(kept: torch.Tensor, buffers: tuple, inv_t: float) -> torch.Tensor:
    """Return z/T for a tile from its matmul output `kept` (rows, cols), as `_tile_logits` computes it, in the tile
    buffer (the accumulation dtype)."""
    rows, cols = kept.shape
    z = buffers[1][: rows * cols].view(rows, cols)
    z.copy_(kept)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def _kept_blocks(ctx, n: int, vocab: int, vocab_block: int, compute_dtype: torch.dtype, device) -> list | None:
    """Return a (N, block) tensor per vocabulary block for the forward's logits to be kept in, or None to recompute
    them in backward: no input needs a gradient, the device is not a CPU, or they would take more than
    `KEPT_LOGITS_BYTES`."""
    if device.type != "cpu" or not any(ctx.needs_input_grad[:2]):
        return None
    if n * vocab * compute_dtype.itemsize > KEPT_LOGITS_BYTES:
        return None
    return [
        torch.empty((n, min(v0 + vocab_block, vocab) - v0), dtype=compute_dtype, device=device)
        for v0 in range(0, vocab, vocab_block)
    ]


def _tiles(n: int, vocab: int, chunk_size: int, vocab_block: int):
    """Yield (token start, token stop, vocab start, vocab stop): vocabulary blocks outside, token chunks inside."""
    for v0 in range(0, vocab, vocab_block):
        for t0 in range(0, n, chunk_size):
            yield t0, min(t0 + chunk_size, n), v0, min(v0 + vocab_block, vocab)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log π(target) and entropy, both with gradient, from hidden states and lm_head weight, in tiles.

    forward(hidden (N, d), weight (V, d), targets (N,) long, settings) -> (logprobs (N,), entropy (N,)),
    both float32 (float64 when compute_dtype is float64); `settings` is a `LogprobSettings` with its
    `compute_dtype` set. The logits are computed one tile of (chunk_size tokens, vocab_block words)
    at a time and never held whole; the logits matmul runs
    in `compute_dtype` (bf16 for bf16 training) and each tile is upcast to float32 for the softmax
    statistics, which are merged across vocabulary blocks online (running max m, Σ e and
    Σ e·(z − m) per token, rescaled when m grows). Autocast is switched off inside both passes so
    forward and backward use exactly `compute_dtype`. Hidden, weight, targets and the per-token
    logsumexp (N,) are saved for backward, and on a CPU the logits themselves where they fit
    (`KEPT_LOGITS_BYTES`; else backward recomputes them). Backward visits the tiles vocabulary block
    by block, so each block's weight gradient is summed over the token chunks and written once.
    With `with_entropy=False` the entropy is returned as zeros, not differentiable. An output the loss
    does not use gets no gradient and costs backward nothing; the entropy's adds one exp per tile.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, settings: LogprobSettings):
        temperature, with_entropy = float(settings.temperature), bool(settings.with_entropy)
        chunk_size, vocab_block, compute_dtype = (
            int(settings.chunk_size),
            int(settings.vocab_block),
            settings.compute_dtype,
        )
        if compute_dtype is None:
            raise ValueError("ChunkedTokenLogprobs needs settings.compute_dtype (token_logprobs chooses one)")
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"expected hidden (N, d) and weight (V, d), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
            )
        if targets.shape != hidden.shape[:1]:
            raise ValueError(f"targets must have shape ({hidden.shape[0]},), got {tuple(targets.shape)}")
        if chunk_size < 1 or vocab_block < 1:
            raise ValueError(f"chunk_size and vocab_block must be positive, got {chunk_size} and {vocab_block}")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        acc_dtype = _accumulation_dtype(compute_dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        inv_t = 1.0 / float(temperature)
        # Per token: running max m, s = Σ exp(z − m), r = Σ exp(z − m)·(z − m), and z[target].
        m = torch.full((n,), float("-inf"), dtype=acc_dtype, device=device)
        s = torch.zeros(n, dtype=acc_dtype, device=device)
        r = torch.zeros(n, dtype=acc_dtype, device=device)
        target_logit = torch.zeros(n, dtype=acc_dtype, device=device)
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            h_all = hidden.to(compute_dtype)  # one cast of (N, d) and of (V, d), not one per tile
            w = weight.to(compute_dtype)
            buffers = _tile_buffers(min(chunk_size, n), min(vocab_block, vocab), compute_dtype, acc_dtype, device)
            onednn = _through_onednn(device, compute_dtype)
            kept = _kept_blocks(ctx, n, vocab, vocab_block, compute_dtype, device) if settings.keep_logits else None
            for t0, t1, v0, v1 in _tiles(n, vocab, chunk_size, vocab_block):
                raw = None if kept is None else kept[v0 // vocab_block][t0:t1]
                z = _tile_logits(h_all[t0:t1], w[v0:v1], buffers, inv_t, onednn, keep=raw)
                local = targets[t0:t1] - v0
                hit = ((local >= 0) & (local < v1 - v0)).nonzero().squeeze(1)
                if hit.numel():
                    target_logit[t0 + hit] = z[hit, local[hit]]
                m_old = m[t0:t1]
                m_new = torch.maximum(m_old, z.amax(dim=1))
                z.sub_(m_new[:, None])  # u = z − m_new
                e = torch.exp(z, out=buffers[2][: z.numel()].view_as(z))
                scale = torch.exp(m_old - m_new)  # 0 for the first block (m_old = −inf)
                shift = torch.where(torch.isfinite(m_old), m_old - m_new, torch.zeros_like(m_new))
                block_s = e.sum(dim=1)
                if with_entropy:
                    block_r = e.mul_(z).sum(dim=1)  # Σ e·u (e is not needed after its sum)
                    r[t0:t1] = scale * (r[t0:t1] + shift * s[t0:t1]) + block_r
                s[t0:t1] = scale * s[t0:t1] + block_s
                m[t0:t1] = m_new
            log_s = torch.log(s)
            lse = m + log_s
            logprobs = target_logit - lse
            entropy = log_s - r / s if with_entropy else torch.zeros(n, dtype=acc_dtype, device=device)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.set_materialize_grads(False)  # an output the loss does not use sends None: no work for it in backward
        ctx.kept = kept  # the logits tiles, per vocabulary block (N, block) in compute_dtype, or None
        ctx.temperature = float(temperature)
        ctx.chunk_size = int(chunk_size)
        ctx.vocab_block = int(vocab_block)
        ctx.compute_dtype = compute_dtype
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprobs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None
        compute_dtype = ctx.compute_dtype
        acc_dtype = lse.dtype
        inv_t = 1.0 / ctx.temperature
        n, vocab = hidden.shape[0], weight.shape[0]
        chunk_size, vocab_block = ctx.chunk_size, ctx.vocab_block
        device = hidden.device
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            h_all = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            # (N,): −g_t / T for the log-probs and for the entropy (None when the loss does not use it)
            neg_g = grad_logprobs.to(acc_dtype) * -inv_t if grad_logprobs is not None else lse.new_zeros(n)
            neg_g_entropy = grad_entropy.to(acc_dtype) * -inv_t if grad_entropy is not None else None
            grad_hidden = torch.zeros(hidden.shape, dtype=acc_dtype, device=device) if need_hidden else None
            grad_weight = (
                (torch.empty if n else torch.zeros)(weight.shape, dtype=weight.dtype, device=device)
                if need_weight
                else None
            )  # every row is written when n > 0
            buffers = _tile_buffers(min(chunk_size, n), min(vocab_block, vocab), compute_dtype, acc_dtype, device)
            # One vocabulary block's grad_z for every token, in compute_dtype: the block's two gradient
            # matmuls then run once over all N tokens, writing into their outputs, instead of once per
            # token chunk with a cast and an add of each partial (which had cost 0.45 s of a 5.6 s update).
            block_grad_z = torch.empty((n, min(vocab_block, vocab)), dtype=compute_dtype, device=device)
            onednn = _through_onednn(device, compute_dtype)
            h_t = h_all.t().contiguous() if onednn and need_weight else None  # (d, N), for every block's ∂W
            kept, ctx.kept = ctx.kept, None
            for t0, t1, v0, v1 in _tiles(n, vocab, chunk_size, vocab_block):
                # grad_z = g/T · (onehot(y) − p) with p = exp(z/T − lse), built in the tile's buffer.
                if kept is None:
                    z = _tile_logits(h_all[t0:t1], w[v0:v1], buffers, inv_t, onednn)
                else:  # the forward's own logits: the same values the matmul would give again
                    z = _kept_tile_logits(kept[v0 // vocab_block][t0:t1], buffers, inv_t)
                log_p = z.sub_(lse[t0:t1, None])
                if neg_g_entropy is None:
                    grad_z = log_p.exp_().mul_(neg_g[t0:t1, None])
                else:  # ∂H/∂z_v = −p_v (log p_v + H) / T, added to the log-probs' (−g/T) p_v
                    p = torch.exp(log_p, out=buffers[2][: log_p.numel()].view_as(log_p))
                    grad_z = log_p.add_(entropy[t0:t1, None]).mul_(neg_g_entropy[t0:t1, None])
                    grad_z = grad_z.add_(neg_g[t0:t1, None]).mul_(p)
                local = targets[t0:t1] - v0
                hit = ((local >= 0) & (local < v1 - v0)).nonzero().squeeze(1)
                if hit.numel():
                    grad_z[hit, local[hit]] -= neg_g[t0:t1][hit]
                block = block_grad_z[:, : v1 - v0]
                block[t0:t1].copy_(grad_z)
                if t1 < n:
                    continue
                # The block's last token chunk: its gradients are complete.
                block_weight = None if grad_weight is None else grad_weight[v0:v1]
                _block_gradients(block, w[v0:v1], h_all, h_t, grad_hidden, block_weight, onednn)
                if kept is not None:
                    kept[v0 // vocab_block] = None  # this block's logits are spent: memory falls as backward goes
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None


def _block_gradients(block, w_block, h_all, h_t, grad_hidden, grad_weight, onednn: bool) -> None:
    """Add one vocabulary block's part of ∂h (grad_hidden += grad_z · W_block) and write its ∂W (grad_weight =
    grad_zᵀ · h), each where asked for (not None).

    block (N, cols) is grad_z in the compute dtype, w_block (cols, d), h_all (N, d), grad_hidden
    (N, d) in the accumulation dtype, grad_weight (cols, d). With `onednn` the products go
    through `onednn_linear` (h_t, h_all transposed (d, N), is then given), else torch's matmuls write into
    the outputs.

    ∂W_block through oneDNN is taken as (hᵀ · grad_z)ᵀ: oneDNN copies a transposed input before it
    multiplies, and grad_zᵀ (4,096 x N) is the larger operand to transpose. Measured at N = 2,160,
    d = 576: 33 ms against 43 for grad_zᵀ · h (MKL's fp32 mm: 51).
    """
    if grad_hidden is not None:
        if onednn:
            grad_hidden += onednn_linear(block, w_block.t())
        elif grad_hidden.dtype == block.dtype:
            grad_hidden.addmm_(block, w_block)
        else:
            grad_hidden += block @ w_block
    if grad_weight is not None:
        if onednn:
            grad_weight.copy_(onednn_linear(h_t, block.t()).t())
        elif grad_weight.dtype == block.dtype:
            torch.mm(block.T, h_all, out=grad_weight)
        else:
            grad_weight.copy_(block.T @ h_all)


def _default_compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """Return bf16 under bf16 autocast for `hidden`'s device, else `hidden`'s own dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16:
        return torch.bfloat16
    return hidden.dtype


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    settings: LogprobSettings = LogprobSettings(),
    *,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (log π(targets), entropy or None) per token, each (batch, seq) float32, without full logits.

        z = hidden · weightᵀ                  (batch, seq, V), never held beyond `chunk_size` tokens
        logprobs = z[target]/T − logsumexp(z/T)          differentiable w.r.t. hidden and weight
        entropy  = logsumexp(z/T) − Σ_v softmax(z/T)_v · z_v/T     differentiable too; None unless with_entropy

    Shapes: hidden (batch, seq, d), weight (V, d) (an lm_head / tied embedding matrix, no bias),
    targets (batch, seq) integer ids. T, the entropy, the tiles and the matmul's dtype are
    `settings` (`LogprobSettings`). Softmax statistics are always taken in float32 (float64 for
    float64 inputs). Gradients come back in the dtypes of `hidden` and `weight`.

    `mask` (batch, seq), 1 on the tokens that count: only those go through the head, and the other
    positions get 0 (log-prob and entropy). Completions padded to the longest in a batch are often a
    third padding (the demo's: 21 tokens on average, padded to 32), and the head is the largest
    matmul of the update.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (batch, seq, d), got shape {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:2])}, got {tuple(targets.shape)}")
    if settings.compute_dtype is None:
        settings = replace(settings, compute_dtype=_default_compute_dtype(hidden))
    if settings.keep_logits and not torch.is_grad_enabled():  # no backward follows (scoring, evaluation)
        settings = replace(settings, keep_logits=False)
    with_entropy = settings.with_entropy
    if mask is not None:
        if mask.shape != targets.shape:
            raise ValueError(f"mask must have shape {tuple(targets.shape)}, got {tuple(mask.shape)}")
        keep = mask.bool()
        if not bool(keep.all()):
            kept_logprobs, kept_entropy = token_logprobs(hidden[keep][None], weight, targets[keep][None], settings)
            logprobs = kept_logprobs.new_zeros(targets.shape).masked_scatter(keep, kept_logprobs[0])
            entropy = (
                kept_entropy.new_zeros(targets.shape).masked_scatter(keep, kept_entropy[0]) if with_entropy else None
            )
            return logprobs, entropy
    batch, seq, d = hidden.shape
    logprobs, entropy = ChunkedTokenLogprobs.apply(
        hidden.reshape(batch * seq, d), weight, targets.reshape(-1).long(), settings
    )
    logprobs = logprobs.view(batch, seq)
    return logprobs, (entropy.view(batch, seq) if with_entropy else None)


def _configs(model) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config]
    get_text_config = getattr(config, "get_text_config", None)
    text_config = get_text_config() if callable(get_text_config) else getattr(config, "text_config", None)
    if text_config is not None and text_config is not config:
        configs.append(text_config)
    return configs


def _is_fsdp_sharded(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(model, FSDPModule)


def supports_fused_logprobs(model) -> bool:
    """Return True when `model`'s logits are exactly `output_embeddings(decoder(...).last_hidden_state)`.

    Decided by what the model is, not by its family's name: `get_decoder` returns a trunk distinct
    from the model, the output layer is a bias-free `nn.Linear` with a (V, d) weight, no config
    field post-processes the logits (`LOGIT_POSTPROCESSING_FIELDS`), and a traced forward shows the
    head reading the trunk's last hidden state with nothing after it (`head_reads_trunk`). When it
    returns False, callers should use the full-logits path.
    """
    get_decoder = getattr(model, "get_decoder", None)
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    if not callable(get_decoder) or not callable(get_output_embeddings):
        return False
    if _is_fsdp_sharded(model):  # the output weight is a shard outside the model's own forward
        return False
    configs = _configs(model)
    if not configs:
        return False
    for config in configs:
        for field in LOGIT_POSTPROCESSING_FIELDS:
            if getattr(config, field, None) is not None:
                return False
    try:
        decoder = get_decoder()
        head = get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        return False
    if decoder is None or decoder is model or not isinstance(head, torch.nn.Linear):
        return False
    if head.bias is not None or head.weight.dim() != 2:
        return False
    key = (id(decoder), id(head))
    traced = _TRACED.get(model)
    if traced is None or traced[0] != key:  # traced once per model (and again if its trunk or head is replaced)
        traced = _TRACED[model] = (key, head_reads_trunk(model, decoder, head))
    return traced[1]


_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ((id(trunk), id(head)), verdict)


def head_reads_trunk(model, decoder, head, length: int = 4) -> bool:
    """Return whether `head` maps the trunk's last hidden state to the logits in one forward of `model` on a few tokens.

    Hooks record what `decoder` returns, what `head` is given and what it returns: the head's input
    must be the trunk's `last_hidden_state` (so the final norm, and nothing else, sits between the
    layers and the head) and the model's logits must be the head's output (no soft-capping, scaling
    or extra layer after it). Run without gradient; a model whose forward fails here is refused.
    """
    seen: dict = {}

    def keep_trunk(module, args, output):
        hidden = getattr(output, "last_hidden_state", None)
        seen["trunk"] = hidden if hidden is not None else (output[0] if isinstance(output, (tuple, list)) else output)

    def keep_head(module, args, output):
        seen["head_in"], seen["head_out"] = args[0] if args else None, output

    weight = head.weight
    input_ids = (torch.arange(length, device=weight.device) % weight.shape[0])[None]
    handles = [decoder.register_forward_hook(keep_trunk), head.register_forward_hook(keep_head)]
    devices = [weight.device] if weight.device.type == "cuda" else []
    try:  # the random streams are put back: a model with dropout draws the same masks as without the trace
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            logits = getattr(model(input_ids=input_ids, use_cache=False), "logits", None)
    except Exception:
        return False
    finally:
        for handle in handles:
            handle.remove()
    trunk, head_in, head_out = seen.get("trunk"), seen.get("head_in"), seen.get("head_out")
    if not all(isinstance(t, torch.Tensor) for t in (trunk, head_in, head_out, logits)):
        return False
    return (
        trunk.shape == head_in.shape
        and torch.equal(trunk, head_in)
        and logits.shape == head_out.shape
        and torch.equal(logits, head_out.to(logits.dtype))
    )


def completion_logprobs_fused(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    completion_ids: torch.Tensor,
    settings: LogprobSettings = LogprobSettings(),
    *,
    completion_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (log-probs, entropy or None) of the completion tokens, each (batch, completion_len) float32.

    Same values as the full-logits path `model(..., logits_to_keep=completion_len + 1).logits[:, :-1]`
    → log_softmax(·/T) → gather, but runs only the trunk and scores the completion positions with
    `token_logprobs` (as `settings` say), so no (batch, completion_len, V) logits tensor is built.
    `input_ids`, `attention_mask`, `position_ids` are (batch, prompt_len + completion_len) with the
    completion (`completion_ids`, (batch, completion_len)) last; the hidden state at position i predicts
    token i + 1, hence positions [-completion_len - 1, -1). Only valid when `supports_fused_logprobs(model)`.
    With `completion_mask` (batch, completion_len) only its tokens are scored; padding positions get 0.
    """
    completion_len = completion_ids.shape[-1]
    if completion_len < 1:
        raise ValueError(f"completion_ids must have a positive length, got shape {tuple(completion_ids.shape)}")
    hidden = model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    hidden = hidden[:, -completion_len - 1 : -1]
    weight = model.get_output_embeddings().weight
    return token_logprobs(hidden, weight, completion_ids, settings, mask=completion_mask)
