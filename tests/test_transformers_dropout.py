"""Attention dropout through the Hugging Face backend, and its refusal by paged attention.

transformers hands the attention function `dropout=attention_dropout` while training and 0.0
in eval mode; maskc's backend passes it on as compiled_attention's dropout_p. A tiny Llama
(two layers, hidden 64, head dim 16, float32, on the CPU through Triton's interpreter) with
attention_dropout=0.3 is checked against itself without dropout, against a re-run under the
same seed, and, for its first layer's call, against the float64 reference with the keep-mask
that maskc.testing.dropout_keep draws from the same generator state.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import maskc  # noqa: E402  (after the importorskip)
import maskc.integrations.transformers as maskc_hf  # noqa: E402

P = 0.3
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert maskc_hf.register() == "maskc"


@pytest.fixture(scope="module")
def models():
    """(dropping, plain): the same weights with attention_dropout P and 0.0, in eval mode."""
    torch.manual_seed(0)
    dropping = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**TINY, attention_dropout=P), attn_implementation="maskc")
    plain = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**TINY, attention_dropout=0.0), attn_implementation="maskc")
    plain.load_state_dict(dropping.state_dict())
    return dropping.eval(), plain.eval()


def _tokens(batch, length, seed=1):
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


class Spy:
    """Wraps maskc.compiled_attention: records each call's q, k, v, keywords, output and the
    state of torch's default CPU generator before it (from which a dropping call draws its seed)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, q, k, v, **kwargs):
        rng = torch.get_rng_state()
        out = self.real(q, k, v, **kwargs)
        self.calls.append(dict(q=q.detach(), k=k.detach(), v=v.detach(), kwargs=kwargs, rng=rng, out=out.detach()))
        return out


@pytest.fixture
def spy(monkeypatch):
    spy = Spy(maskc.compiled_attention)
    monkeypatch.setattr(maskc, "compiled_attention", spy)
    return spy


def test_eval_mode_ignores_attention_dropout(models, spy):
    dropping, plain = models
    ids = _tokens(2, 24)
    with torch.no_grad():
        assert torch.equal(dropping(input_ids=ids).logits, plain(input_ids=ids).logits)
        # decoding steps (kv_lens) in eval mode: a dropout_p there would be refused
        assert torch.equal(dropping.generate(input_ids=ids[:, :12], max_new_tokens=2, do_sample=False),
                           plain.generate(input_ids=ids[:, :12], max_new_tokens=2, do_sample=False))
    assert spy.calls and all(call["kwargs"]["dropout_p"] == 0.0 for call in spy.calls)


def test_train_mode_drops_reproducibly_under_one_seed(models):
    dropping, _ = models
    ids = _tokens(2, 20, seed=2)
    with torch.no_grad():
        evaluated = dropping(input_ids=ids).logits
    dropping.train()
    try:
        outs, grads = [], []
        for _ in range(2):
            torch.manual_seed(7)
            dropping.zero_grad()
            out = dropping(input_ids=ids, labels=ids)
            out.loss.backward()
            outs.append(out.logits.detach())
            grads.append({name: p.grad.clone() for name, p in dropping.named_parameters()})
    finally:
        dropping.eval()
    assert torch.equal(outs[0], outs[1]), "the same seed gave two keep-masks"
    assert not torch.allclose(outs[0], evaluated, atol=1e-3), "train mode dropped nothing"
    for name in grads[0]:
        assert torch.isfinite(grads[0][name]).all(), name
        assert torch.equal(grads[0][name], grads[1][name]), f"{name}: the backward drew another keep-mask"
    for layer in range(TINY["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert grads[0][name].abs().sum() > 0, f"{name} got no gradient"


def test_train_mode_layer_call_matches_the_dropout_reference(models, spy):
    dropping, _ = models
    ids = _tokens(1, 24, seed=3)
    dropping.train()
    try:
        torch.manual_seed(11)
        with torch.no_grad():
            dropping(input_ids=ids)
    finally:
        dropping.eval()
    first = spy.calls[0]
    assert first["kwargs"]["dropout_p"] == P
    q, k, v = first["q"], first["k"], first["v"]
    B, Hq, Lq, _ = q.shape
    torch.set_rng_state(first["rng"])  # the generator as the call found it: it draws the same seed
    keep = maskc.testing.dropout_keep(B, Hq, Lq, k.shape[2], P)
    assert 0 < (~keep).sum() < keep.numel()
    ref, _ = maskc.testing.attention_reference(q, k, v, maskc.masks.causal, scale=first["kwargs"]["scale"],
                                               enable_gqa=True, dropout_keep=keep, dropout_p=P)
    undropped, _ = maskc.testing.attention_reference(q, k, v, maskc.masks.causal, scale=first["kwargs"]["scale"],
                                                     enable_gqa=True)
    torch.testing.assert_close(first["out"].double(), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref, undropped, atol=1e-3)


def test_paged_attention_refuses_dropout():
    torch.manual_seed(4)
    cache = maskc.PagedKVCache(4, 16, 1, 16, dtype=torch.float32, max_seqs=2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    cache.append(slots, torch.randn(2, 1, 20, 16), torch.randn(2, 1, 20, 16))
    q = torch.randn(2, 2, 1, 16)
    with pytest.raises(ValueError, match=r"paged attention decodes.*got dropout_p=0.1; pass dropout_p=0.0"):
        maskc.paged_attention(q, cache, slots, mask_mod=maskc.masks.causal, enable_gqa=True, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"a float in \[0, 1\), got 1.5"):
        maskc.paged_attention(q, cache, slots, mask_mod=maskc.masks.causal, enable_gqa=True, dropout_p=1.5)
    out = maskc.paged_attention(q, cache, slots, mask_mod=maskc.masks.causal, enable_gqa=True, dropout_p=0.0)
    assert torch.equal(out, maskc.paged_attention(q, cache, slots, mask_mod=maskc.masks.causal, enable_gqa=True))
