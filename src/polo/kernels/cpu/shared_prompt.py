"""Score a group's G completions with its prompt computed once: one sequence per group, a block mask.

GRPO samples G completions of the same prompt, and every forward over the rollouts (the
reference's, the policy's in the update) would otherwise run the prompt G times. Here a group
becomes one sequence

    [prompt | completion 1 | completion 2 | ... | completion G]      length L = P + G·C

with an attention mask that lets completion k see the (real) prompt tokens and its own earlier
tokens, never another completion, and position ids that restart after the prompt for every
completion (position of completion token t = number of real prompt tokens + t). Each completion
then gets exactly the hidden states it gets in its own `[prompt | completion]` row, so log-probs
and gradients are the same (up to floating-point summation order); the gradient through the
shared prompt positions is the sum over the group, as it is when the prompt is run G times.

Linear layers and element-wise work shrink from G·(P + C) to P + G·C tokens; dense attention
grows from G·(P + C)² to (P + G·C)² score entries, so `sharing_pays` decides per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "PrefixSplit",
    "SharedAttentionLayout",
    "SharedPromptBatch",
    "share_prompts",
    "shared_attention",
    "sharing_pays",
    "split_common_prefix",
    "without_padding",
]

# Weight of one attention score entry relative to one token through the linear layers, per unit of
# FLOPs: attention ran at about half the FLOP rate of the matmuls on the CPU (its backward more so).
ATTENTION_COST_FACTOR = 2.0


def sharing_pays(
    prompt_len: int,
    completion_len: int,
    group_size: int,
    hidden_size: int,
    params_per_layer: float,
    blockwise: bool = False,
) -> bool:
    """Return True when the shared layout costs clearly less compute than G separate rows.

    Per layer, a token costs ≈ 2·params_per_layer FLOPs in the linear layers and a (query, key)
    pair ≈ 4·hidden_size in attention (QKᵀ and PV), weighted by ATTENTION_COST_FACTOR:

        shared   = (P + G·C)·2·n_layer + A·4·d·f,   A = (P + G·C)² with dense attention,
                                                    A = P² + G·C·(P + C) block-wise (`shared_attention`)
        separate = G·(P + C)·2·n_layer + G·(P + C)²·4·d·f

    Shares when shared < 0.8 · separate. With dense attention the long packed row wins back the
    saving for long completions (P = 100, C = 1024, G = 8 does not share; P = 84, C = 64 does);
    block-wise, sharing never costs more than separate rows, and it pays wherever the prompt is
    a sizeable part of a row (P = 400, C = 512 shares only block-wise).
    """
    if group_size < 2:
        return False
    shared_tokens = prompt_len + group_size * completion_len
    row = prompt_len + completion_len
    per_token, per_pair = 2.0 * params_per_layer, 4.0 * hidden_size * ATTENTION_COST_FACTOR
    pairs = prompt_len**2 + group_size * completion_len * row if blockwise else shared_tokens**2
    shared = shared_tokens * per_token + pairs * per_pair
    separate = group_size * row * per_token + group_size * row**2 * per_pair
    return shared < 0.8 * separate


@dataclass
class SharedAttentionLayout:
    """What `shared_attention` needs to attend block by block instead of over the whole (L, L) mask."""

    prompt_len: int  # P
    group_size: int  # G
    completion_len: int  # C
    prompt_mask: torch.Tensor  # (groups, 1, P, P) bool: prompt queries over prompt keys
    # (groups·G, 1, C, P + C) bool: each completion's queries over [prompt | its own tokens]
    completion_mask: torch.Tensor
    # Set by `without_padding`: the model runs one row of real tokens only, and attention gathers them
    # into the blocks. (groups, P + G·C) long: the real token at each block position (0 for padding) ...
    token_index: torch.Tensor | None = None
    # ... and (T,) long: the flat (groups·(P + G·C)) block position of each real token.
    block_position: torch.Tensor | None = None


@dataclass
class SharedPromptBatch:
    """Inputs of the shared layout for `groups` groups (L = P + G·C)."""

    input_ids: torch.Tensor  # (groups, L)
    attention_mask: torch.Tensor | None  # (groups, 1, L, L) bool, True where a query may attend to a key
    position_ids: torch.Tensor  # (groups, L)
    # (groups·G, C) long: the flat (groups·L) position whose hidden state predicts each completion token
    predictor_index: torch.Tensor
    # the same mask cut into blocks, for attention that skips the blocks that are all False
    layout: SharedAttentionLayout
    real_tokens: torch.Tensor | None = None  # (groups, L) bool: the positions that hold a real token


def share_prompts(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    group_size: int,
) -> SharedPromptBatch | None:
    """Return the shared layout of a batch whose rows come in groups of `group_size` with identical prompts, else None.

    Shapes: prompt (batch, P) left-padded, completion (batch, C) right-padded, as in
    polo.generation.cpu_sampler. None when the batch is not whole groups, or a group's rows
    do not share their prompt ids and mask exactly. `group_size` 1 lays every row out as its own group
    (nothing shared): with `without_padding`, for attention that skips blocks, rows then run unpadded.
    """
    batch, prompt_len = prompt_ids.shape
    completion_len = completion_ids.shape[1]
    if group_size < 1 or batch == 0 or batch % group_size or completion_len == 0:
        return None
    groups, g = batch // group_size, group_size
    grouped_ids, grouped_mask = prompt_ids.view(groups, g, prompt_len), prompt_mask.view(groups, g, prompt_len)
    if not (
        torch.equal(grouped_ids, grouped_ids[:, :1].expand_as(grouped_ids))
        and torch.equal(grouped_mask, grouped_mask[:, :1].expand_as(grouped_mask))
    ):
        return None
    group_prompt_mask = grouped_mask[:, 0].bool()  # (groups, P)
    length = prompt_len + g * completion_len
    input_ids = torch.cat([grouped_ids[:, 0], completion_ids.reshape(groups, g * completion_len)], dim=1)
    key_is_real = torch.cat(
        [group_prompt_mask, completion_mask.bool().reshape(groups, g * completion_len)], dim=1
    )  # (groups, L)

    device = prompt_ids.device  # every index and mask is built beside the batch
    block = torch.cat(
        [torch.full((prompt_len,), -1, device=device), torch.arange(g, device=device).repeat_interleave(completion_len)]
    )  # -1: prompt
    position = torch.arange(length, device=device)
    earlier = position[None, :] <= position[:, None]  # (L, L): key at or before query
    same_block = block[None, :] == block[:, None]
    key_in_prompt = (block == -1)[None, :].expand(length, length)
    structure = earlier & (key_in_prompt | same_block)  # prompt keys for everyone (causally), own block causally
    mask = structure[None] & key_is_real[:, None, :]
    mask |= torch.eye(length, dtype=torch.bool, device=device)[
        None
    ]  # every query sees itself: padding rows are never empty
    real_prompt = group_prompt_mask.long().sum(1)  # (groups,)
    prompt_positions = (group_prompt_mask.long().cumsum(1) - 1).clamp(min=0)
    completion_positions = (real_prompt[:, None] + torch.arange(completion_len, device=device)[None, :]).repeat(1, g)
    position_ids = torch.cat([prompt_positions, completion_positions], dim=1)

    # Token t of completion k in group j is predicted by the hidden state before it: the last prompt
    # position for t = 0, else position P + k·C + t − 1 of the group's row.
    k, t = torch.arange(g, device=device)[:, None], torch.arange(completion_len, device=device)[None, :]
    within = torch.where(t == 0, prompt_len - 1, prompt_len + k * completion_len + t - 1)  # (G, C)
    predictor_index = (torch.arange(groups, device=device)[:, None, None] * length + within[None]).reshape(
        batch, completion_len
    )

    # The same mask, block by block: the prompt's (P, P) corner, and for every completion its rows
    # restricted to [prompt keys | its own keys] (every other block of its rows is all False).
    p, c = prompt_len, completion_len
    prompt_block = mask[:, :p, :p]
    own = torch.stack([mask[:, p + k * c : p + (k + 1) * c, p + k * c : p + (k + 1) * c] for k in range(g)], dim=1)
    to_prompt = mask[:, p:, :p].reshape(groups, g, c, p)
    completion_block = torch.cat([to_prompt, own], dim=3).reshape(batch, c, p + c)
    layout = SharedAttentionLayout(p, g, c, prompt_block[:, None], completion_block[:, None])
    return SharedPromptBatch(input_ids, mask[:, None], position_ids, predictor_index, layout, key_is_real)


@dataclass
class PrefixSplit:
    """Rows of different prompts as one group of `share_prompts`: the prompts' common prefix, then each row's rest.

    Row i's `[prompt_i | completion_i]` becomes `[prefix | rest_i]`, rest_i = the prompt's tokens after
    the prefix followed by the completion's, so the prefix runs once for the batch. Positions, masks
    and hidden states are those of the original rows (`share_prompts` numbers rest_i from the
    prefix's length on, as the original row does).
    """

    prompt_ids: torch.Tensor  # (batch, K) the common prefix, the same in every row
    prompt_mask: torch.Tensor  # (batch, K) all ones
    completion_ids: torch.Tensor  # (batch, C') each row's prompt after the prefix, then its completion, right-padded
    completion_mask: torch.Tensor  # (batch, C')
    offset: torch.Tensor  # (batch,) long: where each row's completion starts in `completion_ids`


def common_prefix_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """Return how many leading real tokens all left-padded prompts (batch, P) share, at most the shortest's length.

    0 when a mask is not plain left padding (one contiguous run of real tokens ending the row).
    """
    prompt_len = prompt_ids.shape[1]
    real = prompt_mask.long().sum(1)  # (batch,)
    columns = torch.arange(prompt_len, device=prompt_ids.device)
    if not torch.equal(prompt_mask.bool(), columns[None] >= (prompt_len - real)[:, None]):
        return 0
    first = prompt_ids.gather(1, (prompt_len - real)[:, None] + columns[None, : int(real.min())])  # (batch, shortest)
    return int((first == first[:1]).all(0).long().cumprod(0).sum())


def split_common_prefix(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> PrefixSplit | None:
    """Return the batch split at the longest prefix of real tokens all its prompts share; None when they share none.

    Shapes as in `share_prompts`: prompts (batch, P) left-padded, completions (batch, C)
    right-padded. None too when a mask is not one contiguous run of real tokens on its side
    (there is then no common layout to cut). SFT demonstrations that open with the same system
    prompt and worked example (the R1 cold start's 102-token prompts share 89) run that part once.
    """
    batch, prompt_len = prompt_ids.shape
    completion_len = completion_ids.shape[1]
    device = prompt_ids.device
    real_prompt, real_completion = prompt_mask.long().sum(1), completion_mask.long().sum(1)  # (batch,)
    completion_columns = torch.arange(completion_len, device=device)
    if batch < 2 or not torch.equal(completion_mask.bool(), completion_columns[None] < real_completion[:, None]):
        return None
    prefix = common_prefix_length(prompt_ids, prompt_mask)
    if prefix == 0:
        return None
    first = prompt_ids[:1, prompt_len - int(real_prompt[0]) :]  # row 0's real tokens, the prefix first
    offset = real_prompt - prefix  # (batch,) each row's prompt tokens after the prefix
    width = int((offset + real_completion).max())
    j = torch.arange(width, device=device)[None]  # (1, C')
    in_prompt, k = j < offset[:, None], j - offset[:, None]  # k: the completion column of position j
    from_prompt = prompt_ids.gather(1, (prompt_len - offset[:, None] + j).clamp(max=prompt_len - 1))
    from_completion = completion_ids.gather(1, k.clamp(0, completion_len - 1))
    return PrefixSplit(
        prompt_ids=first[:, :prefix].expand(batch, prefix),
        prompt_mask=torch.ones(batch, prefix, dtype=prompt_mask.dtype, device=device),
        completion_ids=torch.where(in_prompt, from_prompt, from_completion),
        completion_mask=(in_prompt | ((k >= 0) & (k < real_completion[:, None]))).to(completion_mask.dtype),
        offset=offset,
    )


# The packed row's length is rounded up to a multiple of this many tokens. oneDNN's bf16 matmuls on
# the CPU run ~15 % slower when the row count is not a multiple of 8: SmolLM2-135M's four projection
# shapes at 2,161 rows ran at 821-844 GFLOP/s, at 2,168 rows at 950-956 (time-weighted, torch 2.13,
# a CPU with AVX-512 BF16 whose 2048^3 probe gives ~950).
ROW_MULTIPLE = 8


def without_padding(
    shared: SharedPromptBatch, row_multiple: int = ROW_MULTIPLE, common_prefix: bool = True
) -> SharedPromptBatch:
    """Return the same batch as one row of its real tokens only, for a model whose attention reads the layout's blocks.

    The shared layout pads every prompt to the longest and every completion to the longest; the
    linear layers, norms and MLPs (nearly all of a step's work) do not need the padding. Here the
    model runs (1, T) real tokens (T = Σ real prompt tokens of the groups + Σ completion tokens) with
    their positions, no mask (`attention_mask` None), and `shared_attention` gathers queries, keys and
    values into the padded blocks, attends there and puts the outputs back (`layout.token_index`,
    `layout.block_position`). The log-probs are those of the padded layout; the demo's update runs
    1,777 tokens instead of 2,480. Only for polo's attention: any other ignores the layout.

    With `common_prefix`, the groups' prompts that open alike (a system prompt, a worked example:
    `common_prefix_length`) hold that prefix once in the row: every group's prompt block gathers the same
    real tokens there (the gather's backward sums their gradients over the groups, as G separate
    prompts would). The prefix attends only to itself, so each group's copy of its output is the
    same, and the row keeps the first group's. For r1_zero_arith's 8 groups (a 90-token prefix of
    104-token prompts) the update runs 2,890 instead of 3,520 tokens a step.

    The row ends with up to `row_multiple` - 1 filler tokens (id 0, position 0) so that its length is a
    multiple of `row_multiple`: attention gives them zeros and reads nothing from them, no prediction
    reads them, so they change no log-prob and no gradient.
    """
    groups, length = shared.input_ids.shape
    device = shared.input_ids.device
    owned, prefix_positions = shared.real_tokens.reshape(-1), None
    if common_prefix and groups > 1:
        prefix_positions = group_prefix_positions(shared)
        if prefix_positions is not None:  # the later groups read the first group's prefix tokens
            owned = owned.clone()
            owned[prefix_positions[1:].reshape(-1)] = False
    block_position = owned.nonzero().squeeze(1)  # (T,)
    token_index = torch.zeros(groups * length, dtype=torch.long, device=device)
    token_index[block_position] = torch.arange(block_position.shape[0], device=device)
    if prefix_positions is not None:
        token_index[prefix_positions[1:]] = token_index[prefix_positions[:1]]
    layout = SharedAttentionLayout(
        shared.layout.prompt_len,
        shared.layout.group_size,
        shared.layout.completion_len,
        shared.layout.prompt_mask,
        shared.layout.completion_mask,
        token_index=token_index.view(groups, length),
        block_position=block_position,
    )
    filler = -block_position.shape[0] % row_multiple
    input_ids, position_ids = (
        torch.nn.functional.pad(x.reshape(-1)[block_position], (0, filler))[None]
        for x in (shared.input_ids, shared.position_ids)
    )
    return SharedPromptBatch(
        input_ids=input_ids,
        attention_mask=None,
        position_ids=position_ids,
        predictor_index=token_index[shared.predictor_index],
        layout=layout,
    )


def group_prefix_positions(shared: SharedPromptBatch) -> torch.Tensor | None:
    """Return the flat layout positions (groups, K) of the K leading real prompt tokens all groups share, or None.

    Each group's prompt sits left-padded in the first P columns of its row of the layout; None when
    the prompts share no prefix or their masks are not plain left padding.
    """
    groups, length = shared.input_ids.shape
    prompt_len = shared.layout.prompt_len
    prompt_mask = shared.real_tokens[:, :prompt_len]
    prefix = common_prefix_length(shared.input_ids[:, :prompt_len], prompt_mask)
    if prefix == 0:
        return None
    device = shared.input_ids.device
    first = prompt_len - prompt_mask.long().sum(1)  # (groups,) each prompt's first real column
    columns = first[:, None] + torch.arange(prefix, device=device)[None]
    return torch.arange(groups, device=device)[:, None] * length + columns


def shared_attention(
    attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SharedAttentionLayout
) -> torch.Tensor:
    """Return attention over the shared layout, computed block by block: (groups, L, heads, d) like transformers'.

    `attend(q, k, v, mask)` is an attention function taking (batch, heads, len, d) inputs and a
    (batch, 1, q_len, k_len) bool mask and returning (batch, q_len, heads, d). query is
    (groups, H, L, d), key and value (groups, H_kv, L, d). The prompt attends to itself once per
    group; completion k of a group attends to [the prompt's keys | its own keys], so the work is
    G·C·(P + C) + P² score entries instead of (P + G·C)², and the result equals attention over
    the full (L, L) mask (the blocks skipped are all masked).
    """
    if layout.token_index is not None:  # one row of real tokens (`without_padding`): attend in the blocks
        groups, length = layout.token_index.shape
        index = layout.token_index.reshape(-1)

        # Gathers along the token dimension as whole (h·d) rows with index_select: its backward adds
        # rows (index_add_), where advanced indexing over a middle dimension goes through index_put_
        # with accumulation, 6x slower on the CPU (forward + backward of one layer's queries, 1,808
        # tokens into 2,480 block slots: 0.53 against 3.17 ms; torch 2.13).
        def to_blocks(x: torch.Tensor) -> torch.Tensor:  # (1, h, T, d) -> (groups, h, P + G·C, d)
            return x[0].transpose(0, 1).index_select(0, index).unflatten(0, (groups, length)).transpose(1, 2)

        out = _attend_blocks(attend, to_blocks(query), to_blocks(key), to_blocks(value), layout)
        out = out.reshape(groups * length, *out.shape[2:]).index_select(0, layout.block_position)  # (T, H, d)
        filler = query.shape[2] - out.shape[0]  # `without_padding`'s filler tokens at the row's end get zeros
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, filler))[None]  # (1, T + filler, H, d)
    return _attend_blocks(attend, query, key, value, layout)


def _attend_blocks(attend, query, key, value, layout: SharedAttentionLayout) -> torch.Tensor:
    """Return `shared_attention` over the padded layout: query (groups, H, L, d) -> (groups, L, H, d)."""
    groups, heads, length, dim = query.shape
    p, g, c = layout.prompt_len, layout.group_size, layout.completion_len

    def per_completion(x: torch.Tensor) -> torch.Tensor:  # (groups, h, G·C, d) -> (groups·G, h, C, d)
        h = x.shape[1]
        return x.reshape(groups, h, g, c, x.shape[-1]).transpose(1, 2).reshape(groups * g, h, c, x.shape[-1])

    def prompt_per_completion(x: torch.Tensor) -> torch.Tensor:  # (groups, h, P, d) -> (groups·G, h, P, d)
        h = x.shape[1]
        return x[:, None].expand(groups, g, h, p, x.shape[-1]).reshape(groups * g, h, p, x.shape[-1])

    # split, not slicing: the backward of a slice writes into a zero-filled full-size gradient
    (prompt_q, completion_q), (prompt_k, completion_k), (prompt_v, completion_v) = (
        torch.split(x, [p, length - p], dim=2) for x in (query, key, value)
    )
    prompt_out = attend(prompt_q, prompt_k, prompt_v, layout.prompt_mask)  # (groups, P, H, d)
    keys = torch.cat([prompt_per_completion(prompt_k), per_completion(completion_k)], dim=2)
    values = torch.cat([prompt_per_completion(prompt_v), per_completion(completion_v)], dim=2)
    completion_out = attend(per_completion(completion_q), keys, values, layout.completion_mask)  # (groups·G, C, H, d)
    return torch.cat([prompt_out, completion_out.reshape(groups, g * c, heads, dim)], dim=1)
