"""Score mods and mask mods written the way FlexAttention's own test suite writes them.

Copied from PyTorch's tests, keeping the spelling of every mod exactly as written there (the
point is to run code we did not write):

- FA: pytorch/pytorch test/inductor/test_flex_attention.py
  @ 00125ef3dad64a9f8dd8768e81326a34ed7ba91d
- FD: pytorch/pytorch test/inductor/test_flex_decoding.py
  @ 77b856b102deaf0d981ea3b125f0ca375426ab40

What changed, and only that: PyTorch's tests read module globals B=4, H=8, S=2048 and build
their captured buffers with device="cuda". Here the module-level mods are copied as they are,
with B, H, S small and `test_device` the CPU; mods defined inside a test method are wrapped in
a function named after that test (`from_<test name>`). Where a test's local sets a size for
L=2048 (test_lse_masked_output's SLIDING_WINDOW = 64, documents of 256 tokens), that function
takes it as an argument with a default that fits 56 tokens. The lines that build captured
buffers keep their form with small sizes; a mod's own `def` body is untouched.

Vector operations inside a mod (a reduction over a row of a captured tensor, a dot product,
top-k membership) are marked `# VECTOR OP` below: maskc unrolls them over rows of at most 64
elements (maskc/trace/vector.py) and refuses longer ones with a MaskTraceError.

Not copied: mods that only differ from a copied one by a local variable name
(test_max_autotune's `score * 2`, test_absolute_2d_bias, test_batch_head_bias,
test_multiplicative_bias, test_flipped_indexed_bias, test_max_autotune_with_captured), the
decoding file's q-length-1 variants, and PagedAttention's converted mods (they need the paged
KV cache, not a mod).
"""
import functools
import random

import torch
from torch.nn.attention.flex_attention import _identity, and_masks, noop_mask, or_masks  # noqa: F401

Tensor = torch.Tensor
test_device = "cpu"

# PyTorch's tests: B = 4, H = 8, S = 2048, D = 64; small here for Triton's interpreter. S is the
# kv length of the compatibility test (56) and at least its q length (40).
B = 2
H = 2
S = 56
D = 16


# --------- FA: Useful score mod functions for testing ---------
def _causal(
    score: Tensor,
    batch: Tensor,
    head: Tensor,
    token_q: Tensor,
    token_kv: Tensor,
) -> Tensor:
    return torch.where(token_q >= token_kv, score, float("-inf"))


def _rel_bias(
    score: Tensor,
    batch: Tensor,
    head: Tensor,
    token_q: Tensor,
    token_kv: Tensor,
) -> Tensor:
    return score + (token_q - token_kv)


def _rel_causal(
    score: Tensor,
    batch: Tensor,
    head: Tensor,
    token_q: Tensor,
    token_kv: Tensor,
) -> Tensor:
    return torch.where(token_q >= token_kv, score + (token_q - token_kv), float("-inf"))


def _generate_alibi_bias(num_heads: int):
    def _alibi_bias(
        score: Tensor,
        batch: Tensor,
        head: Tensor,
        token_q: Tensor,
        token_kv: Tensor,
    ) -> Tensor:
        scale = torch.exp2(-((head + 1) * 8.0 / num_heads))
        return score + (token_kv - token_q) * scale

    return _alibi_bias


def _inverse_causal(score, b, h, m, n):
    return torch.where(m <= n, score, float("-inf"))


def _times_two(score, b, h, m, n):
    """Joint graph needed for correctness"""
    return score * 2


def _squared(score, b, h, m, n):
    """Joint graph needed for correctness"""
    return score * score


def _head_offset(dtype: torch.dtype):
    """Captured Buffer"""
    head_offset = torch.rand(H, device=test_device, dtype=dtype)

    def score_mod(score, b, h, m, n):
        return score * head_offset[h]

    return score_mod


def _trig(score, b, h, m, n):
    """Joint graph needed for correctness"""
    return torch.sin(torch.cos(score)) + torch.tan(b)


def _trig2(score, b, h, m, n):
    """Branching joint graph"""
    cos_score = torch.cos(score)
    sin_score = torch.sin(score)
    z = cos_score * sin_score + torch.tan(b)
    return z


# --------- FA: Useful mask mod functions for testing ---------
def _causal_mask(
    batch: Tensor,
    head: Tensor,
    token_q: Tensor,
    token_kv: Tensor,
) -> Tensor:
    return token_q >= token_kv


def _inverse_causal_mask(
    batch: Tensor,
    head: Tensor,
    token_q: Tensor,
    token_kv: Tensor,
) -> Tensor:
    return token_q <= token_kv


# --------- FD: the decoding file's extra module-level mod ---------
def _generate_windowed(offset):
    def _windowed(score, b, h, q, kv):
        return torch.where(q + offset >= kv, score, float("-inf"))

    return _windowed


# --------- FA: mods defined inside TestFlexAttention's methods ---------
def from_test_doc_mask_sparse(doc_len=16):
    document_id = torch.zeros(S, dtype=torch.int, device=test_device)
    for i in range(0, S, doc_len):
        document_id[i : i + doc_len] = i // doc_len

    def document_masking_causal(score, b, h, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx
        document_mask = document_id[q_idx] == document_id[kv_idx]
        return torch.where(causal_mask & document_mask, score, -float("inf"))

    return document_masking_causal


def from_test_index_multiple():
    bias = torch.randn(B, S, device=test_device)

    def index_multiple(score, b, h, q_idx, kv_idx):
        return score + bias[b][q_idx]

    return index_multiple


def from_test_index_weird1():
    bias = torch.randn(4, B, H, S, device=test_device)

    def index_weird1(score, b, h, q_idx, kv_idx):
        return score + bias[0][b, h][q_idx]

    return index_weird1


def from_test_index_weird2():
    bias = torch.randn(B, H, 4, S, device=test_device)
    which_bias = torch.tensor(0, device=test_device)

    def index_weird2(score, b, h, q_idx, kv_idx):
        return score + bias[b][h][which_bias, q_idx]

    return index_weird2


def from_test_skip_odd_keys():
    def score_mod(score, b, h, q, kv):
        return torch.where(kv % 2 == 0, score, float("-inf"))

    return score_mod


def from_test_function_composition():
    def score_mod_1(score, b, h, m, n):
        return score + (m - n)

    def score_mod_2(score, b, h, m, n):
        return torch.where(m <= n, score, float("-inf"))

    def composed_score_mod(score, b, h, m, n):
        return score_mod_2(score_mod_1(score, b, h, m, n), b, h, m, n)

    return composed_score_mod


def from_test_captured_buffers_all_dims():
    head_scale = torch.randn(H, device=test_device)
    batch_scale = torch.randn(B, device=test_device)
    tok_scale = torch.randn(S, device=test_device)

    def all_bias(score, batch, head, token_q, token_kv):
        score = score + tok_scale[token_q]
        score = score + batch_scale[batch]
        score = score + head_scale[head]
        return score

    return all_bias


def from_test_seq_masking():
    seq_idx = torch.zeros(S, device=test_device, dtype=torch.bool)
    seq_idx[S // 2 :] = 1

    def seq_mask_mod(score, b, h, q, kv):
        return torch.where(seq_idx[q] == seq_idx[kv], score, float("-inf"))

    return seq_mask_mod


def from_test_load_from_bias_seq_only(dtype=torch.float32):
    bias = torch.randn(S, S, device=test_device, dtype=dtype)

    def bias_mod(score, b, h, q, kv):
        return score + bias[q, kv]

    return bias_mod


def from_test_load_from_bias_seq_batch(dtype=torch.float32):
    bias = torch.randn(B, S, S, device=test_device, dtype=dtype)

    def bias_mod(score, b, h, q, kv):
        return score + bias[b, q, kv]

    return bias_mod


def from_test_load_from_view_buffer(W=8):
    # The test computes rel_h [B, H, S, S // W] from a module's q projection; the mod is this:
    rel_h = torch.randn(B, H, S, S // W, device=test_device)

    def score_mod(score, batch, head, q_idx, k_idx):
        h_idx = k_idx // W
        return score + rel_h[batch, head, q_idx, h_idx]

    return score_mod


def from_test_load_from_bias_head_seq_batch(dtype=torch.float32):
    bias = torch.randn(B, H, S, S, device=test_device, dtype=dtype)

    def bias_mod(score, b, h, q, kv):
        return score + bias[b, h, q, kv]

    return bias_mod


def from_test_load_rel_bias(dtype=torch.float32):
    rel_bias = torch.randn(2 * S, device=test_device, dtype=dtype)

    def bias_mod(score, b, h, q, kv):
        return score + rel_bias[(q - kv) + S]

    return bias_mod


def from_test_dependent_causal_bidirectional():
    num_bidirectional = torch.randint(0, S, (B,), device=test_device, dtype=torch.int32)

    def bias_mod(score, b, h, q, kv):
        causal_attention = q >= kv
        cur_num_bidirectional = num_bidirectional[b]
        bidirectional_attention_on_video = (q <= cur_num_bidirectional) & (
            kv <= cur_num_bidirectional
        )
        return torch.where(
            bidirectional_attention_on_video | causal_attention,
            score,
            -float("inf"),
        )

    return bias_mod


def from_test_natten_2d():
    H = 8  # the test's 32 rows of S // 32 tokens; 8 rows of 7 here
    W = S // H
    WINDOW = 3
    assert W * H == S

    def get_x_y(idx):
        # This should be a floor divide, but we don't support that properly
        return idx / W, idx % W

    def natten_mask(score, b, h, q, kv):
        q_x, q_y = get_x_y(q)
        kv_x, kv_y = get_x_y(kv)
        return torch.where(
            ((q_x - kv_x).abs() <= WINDOW) | ((q_y - kv_y).abs() <= WINDOW),
            score,
            float("-inf"),
        )

    return natten_mask


def from_test_subgraph_respect_decompostion():
    def score_mod_func(score, b, h, q, kv):
        return score - q // (1 + kv)

    return score_mod_func


def from_test_silu_on_score():
    def silu_score(score, b, h, q, kv):
        return torch.nn.functional.silu(score)

    return silu_score


def from_test_padded_dense_causal():
    seq_len = torch.arange(B, device=test_device, dtype=torch.int32) + 1

    def create_padded_dense_wrapper(orig_score_mod):
        def njt_score_mod(qk, b, h, q, kv):
            return torch.where(
                qk <= seq_len[b], orig_score_mod(qk, b, h, q, kv), -float("inf")
            )

        return njt_score_mod

    causal_njt = create_padded_dense_wrapper(_causal)
    return causal_njt


def from_test_captured_scale():
    scale = torch.ones((), device=test_device, dtype=torch.int32)

    def score_mod_scale(qk, b, h, q, kv):
        return qk + scale

    return score_mod_scale


def from_test_recompile_changed_score_mod():
    """(score_mod_scale, set_add): the test flips ADD between two runs of the same function."""
    scale = torch.ones((), device=test_device, dtype=torch.int32)
    ADD = True

    def score_mod_scale(qk, b, h, q, kv):
        if ADD:
            return qk + scale
        else:
            return qk * scale

    def set_add(value):
        nonlocal ADD
        ADD = value

    return score_mod_scale, set_add


def from_test_captured_reduction():
    scale = torch.randn((B, 8), device=test_device)

    def score_mod_scale(qk, b, h, q, kv):
        return qk + scale[b].sum(dim=-1)  # VECTOR OP: a reduction over a row of a captured tensor

    return score_mod_scale


def from_test_multiple_score_mod_calls():
    def scoremod_1(qk, b, h, q, kv):
        return qk + (q - kv)

    def scoremod_2(qk, b, h, q, kv):
        return torch.where(q >= kv, qk, -float("inf"))

    return scoremod_1, scoremod_2


def from_test_multiple_mask_calls(window_size=8):
    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def causal_mask_slidewindow_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx <= kv_idx + window_size)

    return causal_mask, causal_mask_slidewindow_mod


def from_test_inputs_are_realized():
    x = torch.randn(S, device=test_device)
    x = x * 2

    def func(qk, b, h, q, kv):
        return qk + x[q]

    return func


def from_test_mask_mod_combiners():
    """(and(causal, sliding), and(causal, neg_causal), or(causal, neg_causal)), as the test builds them."""

    def causal_mask(b, h, q, kv):
        return q >= kv

    def neg_causal_mask(b, h, q, kv):
        return q < kv

    def sliding_window(b, h, q, kv):
        return (q - kv) <= 512

    return (and_masks(causal_mask, sliding_window), and_masks(causal_mask, neg_causal_mask),
            or_masks(causal_mask, neg_causal_mask))


def from_test_njt_causal():
    offsets = torch.tensor(
        [0, 20, 20 + 11, S], device=test_device, dtype=torch.int32
    )
    seq_idx = torch.zeros(S, device=test_device, dtype=torch.int32)
    for idx in range(len(offsets) - 1):
        seq_idx[offsets[idx] : offsets[idx + 1]] = idx

    def create_njt_wrapper(orig_score_mod, offsets, seq_idx):
        def njt_score_mod(qk, b, h, q, kv):
            q_nested = q - offsets[seq_idx[q]]
            kv_nested = kv - offsets[seq_idx[kv]]
            return orig_score_mod(qk, b, h, q_nested, kv_nested)

        return njt_score_mod

    causal_njt = create_njt_wrapper(_causal, offsets, seq_idx)
    return causal_njt


def from_test_autograd_function_in_score_mod():
    class ApplyMask(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(a, mask):
            return torch.where(mask, a, -float("inf"))

        @staticmethod
        def setup_context(ctx, inputs, output):
            _, mask = inputs
            ctx.mark_non_differentiable(mask)

        @staticmethod
        def backward(ctx, i):
            return i, None

    def score_mod(score, b, h, q, kv):
        return ApplyMask.apply(score, q <= kv)

    return score_mod


def from_test_new_empty_mask_mod():
    """(score_mod, causal)"""
    attn_mask = torch.ones(B, 1, S, S, dtype=torch.bool, device=test_device).tril()

    def score_mod(score, b, h, q_idx, kv_idx):
        h_ = h.new_zeros(h.shape)
        return score + attn_mask[b, h_, q_idx, kv_idx]

    def causal(b, h, q_idx, kv_idx):
        h_ = h.new_zeros(h.shape)
        return attn_mask[b, h_, q_idx, kv_idx]

    return score_mod, causal


def from_test_fully_masked_out_rows():
    """(mask_mod, noop_mod)"""
    M = S // 2

    def mask_mod(b, h, q, kv):
        return q < M

    def noop_mod(score, b, h, q_idx, kv_idx):
        return score

    return mask_mod, noop_mod


def from_test_comparison_vs_sdpa():
    """(causal score_mod, causal_mask)"""

    def causal(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, -float("inf"))

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return causal, causal_mask


def from_test_block_mask_non_divisible(chunk=16):
    seq = torch.arange(S - 1, device=test_device) // chunk

    def mod(b, h, q, kv):
        return seq[q] == seq[kv]

    return mod


def from_test_head_bias_req_grad(requires_grad=True):
    bias = torch.randn(H, device=test_device, dtype=torch.float16, requires_grad=requires_grad)

    bias_flex = bias.detach().clone().requires_grad_(requires_grad)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias_flex[h]

    return head_bias


# test_comparison_vs_sdpa_with_learnable_bias runs five mods in turn, rebinding bias_flex between
# them; one function per block here, so each mod keeps its own bias. The test's biases require
# grad; these do not (the forward is what they check here; test_head_bias_req_grad's bias checks
# a captured tensor's gradient).
def from_test_comparison_vs_sdpa_with_learnable_bias_1d():
    # 1-dimensional bias:
    bias = torch.randn(2 * S, device=test_device, dtype=torch.float16)

    bias_flex = bias.detach().clone()

    def rel_pos_1d(score, b, h, q_idx, kv_idx):
        return score + bias_flex[q_idx + kv_idx]

    return rel_pos_1d


def from_test_comparison_vs_sdpa_with_learnable_bias_2d():
    # 2-dimensional bias:
    bias = torch.randn(S, S, device=test_device, dtype=torch.float16)

    bias_flex = bias.detach().clone()

    def rel_pos_2d(score, b, h, q_idx, kv_idx):
        return score + bias_flex[q_idx, kv_idx]

    return rel_pos_2d


def from_test_comparison_vs_sdpa_with_learnable_bias_2d_index_multiple():
    # 2-dimensional bias + index multiple
    bias = torch.randn(S, S, device=test_device, dtype=torch.float16)

    bias_flex = bias.detach().clone()

    def rel_pos_2d(score, b, h, q_idx, kv_idx):
        return score + bias_flex[q_idx][kv_idx]

    return rel_pos_2d


def from_test_comparison_vs_sdpa_with_learnable_bias_2d_transposed():
    # 2-dimensional bias + transposed:
    bias = torch.randn(S, S, device=test_device, dtype=torch.float16)

    bias_flex = bias.detach().clone()

    def rel_pos_2d_transposed(score, b, h, q_idx, kv_idx):
        return score + bias_flex[kv_idx, q_idx]

    return rel_pos_2d_transposed


def from_test_comparison_vs_sdpa_with_learnable_bias_3d_transposed():
    # 3-dimensional bias + transposed
    bias = torch.randn(H, S, S, device=test_device, dtype=torch.float16)

    bias_flex = bias.detach().clone()

    def rel_pos_3d_transposed(score, b, h, q_idx, kv_idx):
        return score + bias_flex[h, kv_idx, q_idx]

    return rel_pos_3d_transposed


def from_test_modular_indexing():
    N = S

    def generate_score_mod(bias):
        bias = (2 * bias).view(B, H, N, N).contiguous()

        def score_mod(score, batch, head, q_idx, k_idx):
            attn_bias = bias[batch, head, q_idx, k_idx]
            return score + attn_bias

        return score_mod

    return generate_score_mod(torch.randn(B, N, N, H, device=test_device))


def from_test_lse_masked_output(SLIDING_WINDOW=8):
    """(sliding_window_causal, global_causal)"""

    def sliding_window_causal(b, h, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx
        window_mask = q_idx - kv_idx <= SLIDING_WINDOW
        return causal_mask & window_mask

    def global_causal(b, h, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx
        window_mask = q_idx - kv_idx > SLIDING_WINDOW
        return causal_mask & window_mask

    return sliding_window_causal, global_causal


def from_test_reduction_unrolled():
    # The same mod is in test_cant_lower_error_message and test_captured_wrong_device_error_message.
    means = torch.randn(S, 3, device=test_device)
    length_scales = torch.logspace(0.001, 0.1, H, device=test_device)

    def euclidean_dist_pos_embed(score, b, h, q_idx, k_idx):
        q_pos = means[q_idx]
        k_pos = means[k_idx]
        dist = (q_pos - k_pos).pow(2).sum(-1).sqrt()  # VECTOR OP: a norm over rows of a captured tensor
        scale = length_scales[h]
        inv_dist = torch.exp(-dist / scale)
        return inv_dist * score

    return euclidean_dist_pos_embed


def from_test_dynamic_shapes_bug_dynamic_batch():
    def _flex_attention_mask(b, h, q_idx, kv_idx, input_lengths):
        padding_condition = (q_idx < input_lengths[b]) & (kv_idx < input_lengths[b])
        return padding_condition

    input_lengths = torch.tensor([33, 17], device=test_device)
    return functools.partial(
        _flex_attention_mask,
        input_lengths=input_lengths,
    )


def from_test_causal_block_non_divisible_with_captured_buffer():
    """(score_mod, mask_mod)"""
    Q_S = S - 3
    KV_S = S - 3
    offset_q = torch.randn(Q_S, device=test_device, dtype=torch.bfloat16)
    offset_kv = torch.randn(KV_S, device=test_device, dtype=torch.bfloat16)

    def score_mod(score, b, h, q, kv):
        return score + offset_q[q] + offset_kv[kv]

    def mask_mod(b, h, q, kv):
        return q >= kv

    return score_mod, mask_mod


def from_test_non_divisible_with_captured_buffer():
    Q_S = S + 3

    multiplier = torch.randn(Q_S, device=test_device, dtype=torch.bfloat16)

    def apply_multiplicative_bias(score, b, h, q_idx, kv_idx):
        return score * multiplier[q_idx]

    return apply_multiplicative_bias


def from_test_free_symbol_dynamic():
    """(batch_flip_causal, the create_block_mask lambda over a random dense mask)"""

    def batch_flip_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (b % 2 == 0)

    rand_mask = torch.randint(0, 2, (B, S)).bool()
    return batch_flip_causal, lambda b, h, q_idx, kv_idx: ~rand_mask[b, q_idx]


def from_test_symbol_closure_in_score_mod():
    B, T, C = 2, S, 32  # the test's x.size() inside SimpleAttention.forward
    return lambda s, b, h, q, k: s + B


# --------- FA: mods defined inside TestBlockMask's methods ---------
def from_test_block_mask_attributes():
    """(causal_mask, rebind_offset): the test rebinds `offset` from float zeros to arange(8) and
    builds a second block mask from the same causal_mask."""
    offset = torch.zeros(8, device=test_device)

    def causal_mask(b, h, q, kv):
        return (q + (offset[b] * 128)) >= kv

    def rebind_offset():
        nonlocal offset
        offset = torch.arange(8, device=test_device)

    return causal_mask, rebind_offset


def from_test_compiling_create_block_mask(chunk=13):
    seq = torch.arange(S, device=test_device) // chunk

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (seq[q] == seq[kv])

    return mask_mod


def from_test_doc_mask_clamped_repro():
    """(doc_mask_mod from generate_doc_mask_mod, doc_mask_mod with clamped indices)"""

    def _offsets_to_doc_ids_tensor(offsets):
        device = offsets.device
        counts = offsets[1:] - offsets[:-1]
        return torch.repeat_interleave(
            torch.arange(len(counts), device=device, dtype=torch.int32), counts
        )

    def length_to_offsets(
        lengths: list[int], device
    ) -> Tensor:
        offsets = [0]
        offsets.extend(lengths)
        offsets = torch.tensor(offsets, device=device, dtype=torch.int32)
        offsets = torch.cumsum(offsets, dim=-1)
        return offsets

    def generate_doc_mask_mod(offsets: Tensor):
        document_id = _offsets_to_doc_ids_tensor(offsets)

        def doc_mask_mod(b, h, q_idx, kv_idx):
            same_doc = document_id[q_idx] == document_id[kv_idx]
            return same_doc

        return doc_mask_mod

    rng = random.Random(0)

    def generate_random_lengths(total_length, num_documents):
        lengths = [1] * num_documents
        remaining_length = total_length - num_documents
        for _ in range(remaining_length):
            index = rng.randint(0, num_documents - 1)
            lengths[index] += 1
        return lengths

    device = test_device
    lengths = generate_random_lengths(S, 4)
    offsets = length_to_offsets(lengths, device)
    document_causal_mask = generate_doc_mask_mod(offsets)

    lengths = generate_random_lengths(S - 5, 5)
    offsets = length_to_offsets(lengths, device)
    doc_ids = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        return (
            doc_ids[q_idx.clamp(0, doc_ids.shape[0] - 1)]
            == doc_ids[kv_idx.clamp(0, doc_ids.shape[0] - 1)]
        )

    return document_causal_mask, doc_mask_mod


def from_test_block_mask_reuse_with_weird_mask():
    def mask(b, h, q, kv):
        return (kv < 256) | (kv >= 2048)

    return mask


def from_test_document_masking_edge_case():
    document_masks = torch.full((B, S), 0, dtype=torch.int32, device=test_device)
    document_masks[:, S // 2 :] = 1

    def mask_mod(b, h, q, kv):
        same_doc = document_masks[b, q] == document_masks[b, kv]
        return same_doc

    return mask_mod


# --------- FA: TestLearnableBiases (one function per test method; biases without requires_grad) ---------
# The tests' Params: batch_size=2, num_heads=4, seq_length in (37, 256, 277), head_dim=16.
seq_length, num_heads, batch_size = S, H, B


def from_test_relative_1d_bias():
    bias = torch.randn(2 * seq_length, device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[torch.abs(q_idx - kv_idx)]

    return bias_func


def from_test_head_specific_bias():
    bias = torch.randn(num_heads, seq_length, seq_length, device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    return bias_func


def from_test_local_window_bias():
    window_size = 8
    bias = torch.randn(2 * window_size + 1, device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        window_idx = torch.clamp(q_idx - kv_idx + window_size, 0, 2 * window_size)
        return score + bias[window_idx]

    return bias_func


def from_test_global_tokens_bias():
    bias = torch.randn(seq_length, device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    return bias_func


def from_test_weird_bias():
    bias = torch.randn(batch_size, num_heads, 4, seq_length, device=test_device)
    which_bias = torch.tensor(0, device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, which_bias, q_idx]

    return bias_func


def from_test_indirect_bias():
    bias = torch.randn(seq_length, device=test_device)

    offset = torch.randint(0, seq_length, (seq_length,), device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[offset[q_idx]]

    return bias_func


def from_test_symmetric_bias():
    bias = torch.randn(seq_length, device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx] + bias[kv_idx]

    return bias_func


def from_test_head_specific_gate():
    gate_score = torch.randn(num_heads, device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score * torch.sigmoid(gate_score[h].to(torch.float32))

    return bias_func


def from_test_distinct_biases():
    # Create two separate bias tensors
    bias1 = torch.randn(seq_length, device=test_device)
    bias2 = torch.randn(seq_length, device=test_device)

    def bias_func(score, b, h, q_idx, kv_idx):
        return score + bias1[q_idx] + bias2[kv_idx]

    return bias_func


# --------- FD: mods defined inside TestFlexDecoding's methods ---------
def from_test_paged_attention_page_size(offset=8):
    def generate_causal_offset(offset: torch.Tensor):
        def causal_offset_mask(b, h, q_idx, kv_idx):
            return (offset + q_idx) >= kv_idx

        return causal_offset_mask

    mod = generate_causal_offset(
        torch.tensor(offset, device=test_device, dtype=torch.int32)
    )
    return mod


def from_test_captured_buffers(dtype=torch.float32):
    head_offset = torch.rand(H, device=test_device, dtype=dtype)

    def score_mod(score, b, h, m, n):
        return score + head_offset[h]

    return score_mod
