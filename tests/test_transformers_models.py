"""attn_implementation="maskc" across Hugging Face architectures beyond tests/test_transformers.py:
tiny random models (two layers, hidden 64, head dim 16, vocab 128, float32, CPU through Triton's
interpreter) against the same weights under "sdpa" (or "eager" where the model has no SDPA path).

Each decoder is checked on logits with left padding, with right padding and on 8 greedy tokens
from a left-padded batch; encoder-decoders with padding on either side of the encoder, padded
decoder inputs and generate(); encoders both ways; multimodal text models with their image /
prefix token_type_ids masks. Models that maskc refuses must say why and what to use instead; a
model that gave a silently different answer keeps a test that failed before its fix.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import maskc.integrations.transformers as maskc_hf  # noqa: E402  (after the importorskip)
from _lanes import sampled  # noqa: E402

try:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
except ImportError:  # pragma: no cover
    CONFIG_MAPPING_NAMES = {}

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
            attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
NO_HEAD_DIM = {k: v for k, v in BASE.items() if k != "head_dim"}  # configs where head_dim is a property
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert maskc_hf.register() == "maskc"


def _needs(model_type):
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


def _pair(model_type, kwargs, auto, reference="sdpa"):
    """The same weights under maskc and under `reference` (each model its own config)."""
    _needs(model_type)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    make = getattr(auto, "from_config", None) or auto._from_config
    torch.manual_seed(0)
    ours = make(copy.deepcopy(config), attn_implementation="maskc").eval()
    theirs = make(copy.deepcopy(config), attn_implementation=reference).eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _tokens(batch, length, seed=1):
    # ids from 3 up: no pad, bos or eos inside the prompt
    return torch.randint(3, BASE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _close(ours, theirs):
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def _run(model, **inputs):
    with torch.no_grad():
        out = model(**inputs)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _greedy(models, **inputs):
    runs = []
    for model in models:
        with torch.no_grad():
            runs.append(model.generate(**inputs, max_new_tokens=8, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True))
    ours, theirs = runs
    for got, want in zip(ours.logits, theirs.logits):  # each step's logits, then the tokens
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.sequences, theirs.sequences)


# ---------------------------------------------------------------------------------------------
# decoder-only language models: logits with left and right padding, greedy generate()

DECODERS = {
    "qwen2": {},
    "qwen3_moe": dict(MOE, decoder_sparse_step=1),
    "phi3": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma3_text": dict(SLIDING, query_pre_attn_scalar=16),
    "cohere2": dict(SLIDING),
    "olmo2": {},
    "olmo3": dict(SLIDING),
    "granite": {},
    "stablelm": {},
    "starcoder2": dict(sliding_window=5),
    "gpt_neox": dict(rotary_pct=0.5),
    "smollm3": dict(no_rope_layers=[1, 0]),
    "glm4": {},
    "exaone4": dict(SLIDING),
    "minicpm3": dict(NO_HEAD_DIM, num_key_value_heads=4, **MLA),
    "deepseek_v2": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                        first_k_dense_replace=1, moe_intermediate_size=32, **MLA),
    # chunk of 4 tokens: the left-padded row's chunks start after its padding
    "llama4_text": dict(attention_chunk_size=4, no_rope_layers=[1, 0], num_local_experts=2, num_experts_per_tok=1,
                        intermediate_size_mlp=128, interleave_moe_layer_step=1, attn_temperature_tuning=True),
    "gemma3n_text": dict(SLIDING, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                         num_kv_shared_layers=0, laurel_rank=8, altup_num_inputs=2,
                         activation_sparsity_pattern=[0.0, 0.0], intermediate_size=[128, 128]),
    "gemma4_text": dict(SLIDING, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                        num_kv_shared_layers=0, global_head_dim=16),
    "vaultgemma": dict(query_pre_attn_scalar=16, final_logit_softcapping=None),
    "afmoe": dict(MOE, **SLIDING, num_dense_layers=1),
    "qwen3_next": dict(MOE, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       shared_expert_intermediate_size=32),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=2, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_ff_dim=128, block_auto_adjust_ff_dim=False),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "modernbert-decoder": dict(NO_HEAD_DIM, local_attention=4, global_attn_every_n_layers=2, num_hidden_layers=3,
                               embedding_dropout=0.0, mlp_dropout=0.0),
}
EAGER_ONLY = {"vaultgemma"}  # no SDPA path in transformers


# the default lane: plain GQA, and sliding-window layers beside full ones
@pytest.mark.parametrize("model_type", sampled(DECODERS, keep=["qwen2", "gemma3_text"]))
def test_decoder_matches_reference(model_type):
    kwargs = DECODERS[model_type]
    base = NO_HEAD_DIM if model_type in ("minicpm3", "modernbert-decoder") else BASE
    pair = _pair(model_type, {**base, **kwargs}, transformers.AutoModelForCausalLM,
                 "eager" if model_type in EAGER_ONLY else "sdpa")
    ids = _tokens(2, 12)
    for padded in (slice(0, 4), slice(8, 12)):  # left padding, then right padding, in row 0
        mask = torch.ones_like(ids)
        mask[0, padded] = 0
        ours, theirs = (_run(m, input_ids=ids, attention_mask=mask) for m in pair)
        kept = mask.bool()  # padded queries' outputs are not defined
        _close(ours[kept], theirs[kept])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    _greedy(pair, input_ids=ids, attention_mask=mask, pad_token_id=0)


# ---------------------------------------------------------------------------------------------
# encoder-decoders: cross-attention masks from the encoder's padding

BART = dict(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, init_std=0.1, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1, max_position_embeddings=128, forced_eos_token_id=None)
T5GEMMA_HALF = dict(NO_HEAD_DIM, **SLIDING, head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=None,
                    final_logit_softcapping=None)
SEQ2SEQ = {
    "marian": (dict(BART, decoder_vocab_size=128), "sdpa"),
    # sliding-window and full layers on both sides, bidirectional sliding encoder
    "t5gemma": (dict(encoder=T5GEMMA_HALF, decoder=T5GEMMA_HALF, vocab_size=128, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, decoder_start_token_id=1, dropout_rate=0.0, attention_dropout=0.0), "eager"),
}


@pytest.mark.slow  # the default lane runs bart in tests/test_transformers.py
@pytest.mark.parametrize("model_type", list(SEQ2SEQ))
def test_encoder_decoder_matches_reference(model_type):
    kwargs, reference = SEQ2SEQ[model_type]
    pair = _pair(model_type, kwargs, transformers.AutoModelForSeq2SeqLM, reference)
    ids, decoder_ids = _tokens(2, 12), _tokens(2, 7, seed=2)
    decoder_mask = torch.ones_like(decoder_ids)
    decoder_mask[1, :2] = 0
    for padded in ((0, slice(8, 12)), (1, slice(0, 3))):  # right, then left padding of the encoder
        mask = torch.ones_like(ids)
        mask[padded] = 0
        ours, theirs = (_run(m, input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                             decoder_attention_mask=decoder_mask) for m in pair)
        _close(ours[decoder_mask.bool()], theirs[decoder_mask.bool()])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    _greedy(pair, input_ids=ids, attention_mask=mask)


@pytest.mark.slow
def test_whisper_matches_sdpa():
    config = dict(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=8,
                  max_source_positions=8, max_target_positions=64, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                  init_std=0.1, begin_suppress_tokens=None, suppress_tokens=None)
    pair = _pair("whisper", config, transformers.WhisperForConditionalGeneration)
    features = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    decoder_ids = _tokens(2, 7, seed=2)
    decoder_mask = torch.ones_like(decoder_ids)
    decoder_mask[1, :2] = 0
    inputs = dict(input_features=features, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask)
    ours, theirs = (_run(m, **inputs) for m in pair)
    _close(ours[decoder_mask.bool()], theirs[decoder_mask.bool()])
    _greedy(pair, **inputs)


# ---------------------------------------------------------------------------------------------
# bidirectional encoders

ENCODERS = {
    "modernbert": dict(NO_HEAD_DIM, global_attn_every_n_layers=2, local_attention=4, num_hidden_layers=3,
                       embedding_dropout=0.0, mlp_dropout=0.0),
    "eurobert": dict(NO_HEAD_DIM),
    "distilbert": dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0,
                       attention_dropout=0.0),
    "esm": dict(NO_HEAD_DIM, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, mask_token_id=3,
                position_embedding_type="rotary"),
    # EmbeddingGemma-style: Gemma 3 with bidirectional attention (an or_mask_function) and sliding layers
    "gemma3_text": dict(BASE, **SLIDING, query_pre_attn_scalar=16, use_bidirectional_attention=True),
}


@pytest.mark.parametrize("model_type", sampled(ENCODERS, keep=["distilbert"]))
def test_encoder_matches_sdpa(model_type):
    pair = _pair(model_type, ENCODERS[model_type], transformers.AutoModel)
    ids = _tokens(2, 12)
    for padded in ((0, slice(8, 12)), (1, slice(0, 3))):
        mask = torch.ones_like(ids)
        mask[padded] = 0
        ours, theirs = (_run(m, input_ids=ids, attention_mask=mask) for m in pair)
        _close(ours[mask.bool()], theirs[mask.bool()])


# ---------------------------------------------------------------------------------------------
# multimodal text models: image tokens attend to each other both ways (Gemma 3), a bidirectional
# prefix (PaliGemma), both from token_type_ids

IMAGE = 120
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4, attention_dropout=0.0)


@pytest.mark.slow  # the prefix masks themselves run in tests/test_compat_transformers_masks.py
@pytest.mark.parametrize("model_type", ["gemma3", "paligemma"])
def test_image_token_masks_match_reference(model_type):
    _needs(model_type)
    text = dict(BASE, **SLIDING, query_pre_attn_scalar=16)
    if model_type == "gemma3":
        config = transformers.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4,
                                           image_token_id=IMAGE, boi_token_index=121, eoi_token_index=122)
        auto, reference, n_image = transformers.Gemma3ForConditionalGeneration, "sdpa", 4
    else:
        text.update(model_type="gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
        config = transformers.PaliGemmaConfig(text_config=text, vision_config=VISION, image_token_id=IMAGE,
                                              projection_dim=64, vocab_size=128)
        auto, reference, n_image = transformers.PaliGemmaForConditionalGeneration, "eager", 16
    torch.manual_seed(0)
    pair = [auto._from_config(copy.deepcopy(config), attn_implementation=impl).eval() for impl in ("maskc", reference)]
    pair[1].load_state_dict(pair[0].state_dict())
    length = n_image + 10
    ids = _tokens(2, length)
    ids[ids >= IMAGE] = 5
    if model_type == "gemma3":  # one image in each row, at different places; token type 1: image
        ids[0, 4:4 + n_image] = IMAGE
        ids[1, 5:5 + n_image] = IMAGE
        token_types = (ids == IMAGE).long()
    else:  # image then 3 prompt tokens: the prefix (token type 0), then the suffix (1)
        ids[:, 2:2 + n_image] = IMAGE
        token_types = torch.ones_like(ids)
        token_types[:, :2 + n_image + 3] = 0
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    for row, padded in ((1, slice(0, 2)), (0, slice(length - 3, length))):
        mask = torch.ones_like(ids)
        mask[row, padded] = 0
        inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=token_types)
        ours, theirs = (_run(m, **inputs) for m in pair)
        _close(ours[mask.bool()], theirs[mask.bool()])
    causal_only = _run(pair[1], **{**inputs, "token_type_ids": torch.zeros_like(ids) if model_type == "gemma3"
                                   else torch.ones_like(ids)})
    assert not torch.allclose(causal_only[mask.bool()], theirs[mask.bool()], atol=1e-3), "token types changed nothing"
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    _greedy(pair, input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=token_types)


# ---------------------------------------------------------------------------------------------
# refusals: the error names the feature (or the model's own use of the mask) and the way out

REFUSALS = {
    "inkling_text": (dict(BASE), NotImplementedError,
                     r"does not take a position bias tensor \(T5-style\) yet, got position_bias; use "
                     r"attn_implementation='eager' or 'sdpa'"),
    "mpt": (dict(NO_HEAD_DIM, d_model=64, n_heads=4, n_layers=2, expansion_ratio=2), AttributeError,
            r"works on its attention mask as a tensor \(its \.to\).*use attn_implementation='sdpa' or 'eager'"),
    "xglm": (dict(NO_HEAD_DIM, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, dropout=0.0),
             AttributeError, r"works on its attention mask as a tensor \(its \.size\)"),
}


@pytest.mark.slow
def test_gemma4_kv_shared_layers_slice_their_mask():
    """Gemma 4 with KV-shared layers (the E2B / E4B configs) keeps only the rows of the logits
    asked for in those layers: mask[:, :, -n:, :] of each kind's mask (logits_to_keep n; 0
    keeps every row), then generate()."""
    pair = _pair("gemma4_text", dict(BASE, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                                     num_hidden_layers=4, hidden_size_per_layer_input=8,
                                     vocab_size_per_layer_input=128, num_kv_shared_layers=2, global_head_dim=32),
                 transformers.AutoModelForCausalLM)
    ids = _tokens(2, 12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for keep in (1, 3, 0):
        ours, theirs = (_run(m, input_ids=ids, attention_mask=mask, logits_to_keep=keep) for m in pair)
        _close(ours, theirs)
    _greedy(pair, input_ids=ids, attention_mask=mask, pad_token_id=0)


def test_a_layer_mask_refuses_other_indexing():
    from transformers.masking_utils import causal_mask_function

    mask = maskc_hf.layer_mask(1, 6, 6, mask_function=causal_mask_function)
    assert mask[:, :, -2:, :].q_len == 2
    with pytest.raises(TypeError, match=r"as a tensor \(indexing it with \(0, 1\)\).*'sdpa' or 'eager'"):
        mask[0, 1]


@pytest.mark.parametrize("model_type", list(REFUSALS))
def test_refused_models_say_why(model_type):
    kwargs, error, message = REFUSALS[model_type]
    _needs(model_type)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="maskc").eval()
    with pytest.raises(error, match=message), torch.no_grad():
        model(input_ids=_tokens(2, 12))


def test_t5_is_refused_for_its_position_bias():
    config = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                  decoder_start_token_id=0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(transformers.AutoConfig.for_model("t5", **config),
                                                           attn_implementation="maskc").eval()
    with pytest.raises(NotImplementedError, match=r"position bias tensor \(T5-style\) yet, got position_bias"):
        model(input_ids=_tokens(2, 8), decoder_input_ids=_tokens(2, 4))


@pytest.mark.parametrize("model_type, kwargs", [
    ("falcon", dict(NO_HEAD_DIM, new_decoder_architecture=True, num_kv_heads=2)),
    ("gpt_neo", dict(BASE, attention_types=[[["global", "local"], 1]], window_size=4, num_layers=2, num_heads=4)),
])
def test_fixed_attention_tables_build_and_match_or_fail_in_transformers(model_type, kwargs):
    """Falcon and GPT-Neo choose their attention class from a table keyed by implementation name.
    Releases of transformers whose table lacks "maskc" fail at build with a KeyError naming it (not
    maskc's doing, and nothing maskc could catch); releases that dispatch through the attention
    interface build, and then the model must match SDPA like every other decoder."""
    _needs(model_type)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    try:
        transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="maskc")
    except KeyError as error:
        assert "maskc" in str(error)
        return
    pair = _pair(model_type, kwargs, transformers.AutoModelForCausalLM)
    ids = _tokens(2, 12)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ours, theirs = (_run(m, input_ids=ids, attention_mask=mask) for m in pair)
    _close(ours[mask.bool()], theirs[mask.bool()])
    _greedy(pair, input_ids=ids, attention_mask=mask, pad_token_id=0)


# ---------------------------------------------------------------------------------------------
# the _StepMask sharing hazard, fixed: two masks of one structure (both bidirectional, both padded)
# built in one forward pass before either is used. _StepMask.of had interned both under
# (_structure(fn), padding is None) and rebound the one MaskMod, so the first LayerMask read the
# second's padding; the place the model builds each mask now keeps them apart.


@pytest.mark.parametrize("queries_padded", [True, False], ids=["both padded", "image padded"])
def test_qformer_with_a_padded_image_matches_eager(queries_padded):
    config = transformers.Blip2QFormerConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=128, attention_probs_dropout_prob=0.0,
                                             hidden_dropout_prob=0.0, encoder_hidden_size=64,
                                             cross_attention_frequency=1, initializer_range=0.1)
    torch.manual_seed(0)
    pair = [transformers.Blip2QFormerModel._from_config(copy.deepcopy(config), attn_implementation=impl).eval()
            for impl in ("maskc", "eager")]
    pair[1].load_state_dict(pair[0].state_dict())
    g = torch.Generator().manual_seed(1)
    queries, image = torch.randn(2, 6, 64, generator=g), torch.randn(2, 16, 64, generator=g)
    query_mask = torch.ones(2, 6, dtype=torch.long)
    query_mask[0, 4:] = 0 if queries_padded else 1  # unpadded: the query mask has no padding to capture
    image_mask = torch.ones(2, 16, dtype=torch.long)
    image_mask[1, 5:] = 0
    ours, theirs = (_run(m, query_embeds=queries, attention_mask=query_mask, encoder_hidden_states=image,
                         encoder_attention_mask=image_mask) for m in pair)
    _close(ours[query_mask.bool()], theirs[query_mask.bool()])


def test_two_masks_of_one_structure_in_one_pass_keep_their_own_padding():
    from transformers.masking_utils import bidirectional_mask_function

    first_padding = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    second_padding = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    first = maskc_hf.layer_mask(2, 6, 6, mask_function=bidirectional_mask_function, attention_mask=first_padding)
    maskc_hf.layer_mask(2, 6, 8, mask_function=bidirectional_mask_function, attention_mask=second_padding)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 16, generator=g) for _ in range(3))
    out, _ = maskc_hf.attention_forward(torch.nn.Module(), q, k, v, first)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=first_padding[:, None, None, :])
    _close(out, expected.transpose(1, 2))
