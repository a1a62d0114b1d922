"""The Hugging Face transformers backend: tiny randomly initialised models give the logits,
gradients and generated tokens of transformers' own attention with attn_implementation="maskc".

Models are built from configs (no download), two layers, hidden 64, head dim 16, float32, on
the CPU through Triton's interpreter; weights are drawn wider than transformers' default so
that attention is far from uniform and a wrong mask shows in the logits.
"""
from __future__ import annotations

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import maskc  # noqa: E402  (after the importorskip)
import maskc.integrations.transformers as maskc_hf  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert maskc_hf.register() == "maskc"


def _pair(config, reference="sdpa"):
    """The same weights under maskc and under `reference`."""
    torch.manual_seed(0)
    # each model gets its own config: from_config records the implementation on the config it
    # is given, so two models sharing one would both run the last one asked for
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="maskc")
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "maskc"
    return ours.eval(), theirs.eval()


@pytest.fixture(scope="module")
def llama():
    return _pair(transformers.LlamaConfig(**TINY))


def _tokens(batch, length, seed=1):
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, **inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _close(ours, theirs):
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_logits_match_sdpa(llama):
    ids = _tokens(2, 24)
    _close(*(_logits(m, input_ids=ids) for m in llama))


def test_left_padding_matches_sdpa(llama):
    ids = _tokens(2, 24)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    ours, theirs = (_logits(m, input_ids=ids, attention_mask=mask) for m in llama)
    kept = mask.bool()  # padded queries attend to nothing: their logits are not defined
    _close(ours[kept], theirs[kept])


def test_packed_sequences_match_sdpa(llama):
    # position_ids restarting inside a row: transformers finds three documents in row 0, two in row 1
    ids = _tokens(2, 24)
    positions = torch.cat([torch.arange(9), torch.arange(10), torch.arange(5)]).repeat(2, 1)
    positions[1] = torch.cat([torch.arange(15), torch.arange(9)])
    ours, theirs = (_logits(m, input_ids=ids, position_ids=positions, use_cache=False) for m in llama)
    _close(ours, theirs)
    unpacked = _logits(llama[1], input_ids=ids, use_cache=False)
    assert not torch.allclose(theirs[:, 9:], unpacked[:, 9:], atol=1e-3), "the documents did not change the logits"


def test_gradients_match_sdpa(llama):
    ids = _tokens(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: padded keys are dropped in the backward pass too
    labels = ids.masked_fill(mask == 0, -100)
    # the first real token is predicted from the last padded position, whose query keeps no key:
    # its output is not defined (maskc gives 0, eager attention the mean of v)
    labels[1, 5] = -100
    grads = []
    for model in llama:
        model.train()
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        model.eval()
    ours, theirs = grads
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


def test_generate_matches_sdpa(llama):
    # left padding, then one query a step against the cache: the mask is offset by the cache length
    ids = _tokens(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ours, theirs = (m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
                    for m in llama)
    assert torch.equal(ours, theirs)


def test_generate_with_a_static_cache_matches_sdpa(llama):
    # a static cache: generate() builds each step's masks ahead, the query offset comes as a
    # tensor, and the keys are the whole cache, its empty slots included
    ids = _tokens(2, 10, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ours, theirs = (m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                               cache_implementation="static") for m in llama)
    assert torch.equal(ours, theirs)


def test_sliding_window_matches_sdpa():
    # Mistral's sliding_window for every layer; generating past the window exercises the
    # sliding cache, whose keys start at an offset
    config = transformers.MistralConfig(**TINY, sliding_window=5)
    ours, theirs = _pair(config)
    ids = _tokens(2, 16)
    _close(_logits(ours, input_ids=ids), _logits(theirs, input_ids=ids))
    short = ids[:, :8]
    generated = [m.generate(input_ids=short, attention_mask=torch.ones_like(short), max_new_tokens=3,
                            do_sample=False) for m in (ours, theirs)]
    assert torch.equal(*generated)


def test_gemma2_softcap_and_sliding_layers_match_eager():
    # per-layer layer_types, logit softcapping (a score_mod), query_pre_attn_scalar scaling;
    # Gemma 2 has no SDPA path (SDPA cannot softcap), so eager is the reference
    config = transformers.Gemma2Config(**TINY, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                       attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                       query_pre_attn_scalar=16)
    ours, theirs = _pair(config, reference="eager")
    ids = _tokens(2, 16)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ours, theirs = (_logits(m, input_ids=ids, attention_mask=mask) for m in (ours, theirs))
    _close(ours[mask.bool()], theirs[mask.bool()])


def test_no_mask_is_causal_after_the_cache():
    # a layer called without a mask (a module on its own): queries are the last Lq of the keys,
    # within the layer's sliding_window when it has one
    q, k, v = (torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(n)) for n in (3, 9, 9))
    distance = torch.arange(3)[:, None] + 6 - torch.arange(9)[None, :]
    for window, allowed in ((None, distance >= 0), (4, (distance >= 0) & (distance < 4))):
        out, weights = maskc_hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, None,
                                                  sliding_window=window)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        assert weights is None
        _close(out, expected.transpose(1, 2))


def test_refusals_say_why(llama):
    config = transformers.LlamaConfig(**{**TINY, "attention_dropout": 0.1})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="maskc").train()
    ids = _tokens(1, 8)
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)  # a prefill drops while training
        # a decoding step reaches the decoding kernel, which has no dropout
        with pytest.raises(ValueError, match=r"dropout=0.1.* decoding step .*model.eval\(\) before generate"):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    dense = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(TypeError, match=r"got a 4-d torch.bool tensor .*2-d attention_mask"):
        llama[0](input_ids=ids, attention_mask=dense)


@pytest.mark.slow  # Dynamo compiles the model three times; maskc's operators under compile: test_torch_compile.py
def test_torch_compile_of_the_model_runs_without_recompiling():
    # the model's mask functions run outside the graph (one break per forward pass, in
    # layer_mask); the layers compile once without padding and once with it (another mask
    # function), then run again for new padding and new tokens
    from torch._dynamo.utils import counters

    ours, theirs = _pair(transformers.LlamaConfig(**TINY))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ours, backend="aot_eager")
    graphs = []
    for step, pad in enumerate((0, 5, 3, 0, 7)):
        ids = _tokens(2, 20, seed=10 + step)
        mask = torch.ones_like(ids)
        mask[1, :pad] = 0
        labels = ids.masked_fill(mask == 0, -100)
        if pad:
            labels[1, pad] = -100  # predicted from a padded query (test_gradients_match_sdpa)
        grads = []
        for model in (compiled, theirs):
            model.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[1]] * 4, f"recompiled: unique graphs after each step {graphs}"
    breaks = [reason for reason in counters["graph_break"] if "layer_mask" not in reason]
    assert len(breaks) <= 1 and all("dict_keyiterator" in b for b in breaks), breaks  # transformers' own
    torch._dynamo.reset()


def test_mask_structures_tell_windows_apart_and_ignore_tensors():
    # one MaskMod per structure: a second window size must not rebind the first's in one pass
    from transformers.masking_utils import and_masks, causal_mask_function, padding_mask_function, \
        sliding_window_overlay

    def sliding(w):
        return and_masks(sliding_window_overlay(w), causal_mask_function)

    structure = maskc_hf._structure
    assert structure(sliding(4)) == structure(sliding(4))
    assert structure(sliding(4)) != structure(sliding(8))
    padded = [and_masks(causal_mask_function, padding_mask_function(torch.ones(2, n, dtype=torch.bool)))
              for n in (5, 9)]
    assert structure(padded[0]) == structure(padded[1])  # tensors are values the trace guards

    def unbound():
        def later(b, h, q_idx, kv_idx):
            return q_idx >= limit
        found = structure(later)  # `limit` is not bound yet: an empty cell
        limit = 3  # noqa: F841
        return found

    assert unbound()


@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_t5_relative_position_bucket_runs_as_transformers_writes_it(bidirectional):
    """T5's bucket function, unchanged, bound by functools.partial as a score mod's bias table
    index: math.log of its bound numbers and the decoder's two-tensor torch.min were refused."""
    import functools

    from transformers.models.t5.modeling_t5 import T5Attention

    from maskc.testing.reference import attention_reference

    bucket = functools.partial(T5Attention._relative_position_bucket, bidirectional=bidirectional, num_buckets=32,
                               max_distance=32)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(32, 2, generator=g)

    def t5_bias(score, b, h, q_idx, kv_idx):
        return score + table[bucket(kv_idx - q_idx), h]

    q, k, v = (torch.randn(1, 2, 70, 16, generator=g) for _ in range(3))
    out = maskc.compiled_attention(q, k, v, score_mod=t5_bias)
    ref, _ = attention_reference(q, k, v, score_mod=t5_bias)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


# Architectures beyond Llama, each for an attention feature the Llama tests do not reach
# (picked from a CPU sweep of 68 transformers architectures against sdpa or eager, commit
# cfe100a, 2026-11-27): chunked attention, multi-head latent attention (q/k head dim 32, v 16),
# a bidirectional encoder and an encoder-decoder with cross-attention.
ARCHITECTURES = {
    "llama4_text": dict(attention_chunk_size=8, no_rope_layers=[1, 0], num_local_experts=2, num_experts_per_tok=1,
                        intermediate_size_mlp=128, interleave_moe_layer_step=1, attn_temperature_tuning=True),
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                        topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32),
    "bert": dict(attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0),
    "bart": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=128, decoder_ffn_dim=128, init_std=0.1, dropout=0.0, attention_dropout=0.0,
                 activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
}


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_other_architectures_match_sdpa(model_type):
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **ARCHITECTURES[model_type]})
    auto = {"bert": transformers.AutoModel, "bart": transformers.AutoModelForSeq2SeqLM}.get(
        model_type, transformers.AutoModelForCausalLM)
    torch.manual_seed(0)
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="maskc").eval()
    theirs = auto.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    ids = _tokens(2, 20)
    mask = torch.ones_like(ids)
    inputs = dict(input_ids=ids, attention_mask=mask)
    if model_type == "bart":
        inputs["decoder_input_ids"] = _tokens(2, 10, seed=2)
    if model_type in ("bert", "bart"):
        mask[0, -6:] = 0  # right padding: the encoder's padded keys dropped, both ways
    else:
        mask[0, :7] = 0
    with torch.no_grad():
        got, want = (m(**inputs) for m in (ours, theirs))
    if model_type == "bert":
        _close(got.last_hidden_state[mask.bool()], want.last_hidden_state[mask.bool()])
    elif model_type == "bart":
        _close(got.logits, want.logits)
    else:
        _close(got.logits[mask.bool()], want.logits[mask.bool()])


@pytest.mark.parametrize("model_type, extra", [("bloom", dict(n_layer=2, n_head=4)),
                                               ("doge", dict(num_key_value_heads=2, head_dim=16))])
def test_a_model_that_works_on_its_mask_is_told_to_use_another_backend(model_type, extra):
    # bloom adds its ALiBi to the mask, doge asks its dtype: both crashed in their own code
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="maskc").eval()
    with pytest.raises((TypeError, AttributeError), match="this model works on its attention mask as a tensor .*"
                                                          "use attn_implementation='sdpa' or 'eager'"), torch.no_grad():
        model(input_ids=_tokens(1, 16))


def test_a_layer_mask_used_as_a_tensor_says_so():
    mask = maskc_hf.LayerMask(maskc.masks.causal, 4, 4)
    for use in (lambda m: m[:, :, :2], lambda m: ~m, lambda m: -m, lambda m: m * 2, lambda m: torch.ones(1) + m,
                lambda m: m.dtype):
        with pytest.raises((TypeError, AttributeError), match="works on its attention mask as a tensor"):
            use(mask)
    assert not hasattr(mask, "dtype") and getattr(mask, "size", None) is None  # hasattr and defaults still work
