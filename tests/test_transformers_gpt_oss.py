"""gpt-oss through the Hugging Face backend: transformers passes each layer's sinks parameter as
`s_aux`, which becomes maskc's sinks. A tiny GptOssForCausalLM (sliding-window and full layers
alternating, grouped-query attention, two experts, float32 on the CPU) under
attn_implementation="maskc" gives eager attention's logits, greedy tokens and parameter
gradients, the sinks' included.

The sinks are drawn wide (transformers initialises them near 0), so that a sink ignored or
misplaced shows in the logits.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GptOssConfig"):
    pytest.skip("this transformers has no gpt-oss", allow_module_level=True)

import maskc.integrations.transformers as maskc_hf  # noqa: E402  (after the importorskip)

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"], num_local_experts=2,
            num_experts_per_tok=1, attention_dropout=0.0)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert maskc_hf.register() == "maskc"


@pytest.fixture(scope="module")
def gpt_oss():
    """The same weights under maskc and eager attention, sinks drawn wide."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**TINY)
    ours = transformers.GptOssForCausalLM._from_config(copy.deepcopy(config), attn_implementation="maskc")
    theirs = transformers.GptOssForCausalLM._from_config(copy.deepcopy(config), attn_implementation="eager")
    with torch.no_grad():
        for i, layer in enumerate(ours.model.layers):
            layer.self_attn.sinks.copy_(torch.randn(4, generator=torch.Generator().manual_seed(i)) * 2.0)
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "maskc"
    return ours.eval(), theirs.eval()


def _tokens(batch, length, seed=1):
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, **inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _close(ours, theirs):
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_logits_match_eager(gpt_oss):
    ids = _tokens(2, 14)
    _close(*(_logits(m, input_ids=ids) for m in gpt_oss))


def test_left_padding_matches_eager(gpt_oss):
    ids = _tokens(2, 14)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ours, theirs = (_logits(m, input_ids=ids, attention_mask=mask) for m in gpt_oss)
    kept = mask.bool()  # padded queries keep no key: their logits are not compared
    _close(ours[kept], theirs[kept])


def test_generate_matches_eager(gpt_oss):
    # prefill past the window, then one query a step against the cache
    ids = _tokens(2, 9, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ours, theirs = (m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               pad_token_id=0) for m in gpt_oss)
    assert torch.equal(ours, theirs)


def test_gradients_match_eager(gpt_oss):
    ids = _tokens(2, 12, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100  # predicted from the last padded position, whose output is not defined
    grads = []
    for model in gpt_oss:
        model.train()
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        model.eval()
    ours, theirs = grads
    assert ours.keys() == theirs.keys()
    assert any(name.endswith("self_attn.sinks") for name in ours)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)
