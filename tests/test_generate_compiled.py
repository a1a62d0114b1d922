"""transformers' static-cache generate() with its forward compiled, as its fast path runs it
(there with CUDA graphs: mode="reduce-overhead"): the tokens are SDPA's, and a decoding step
records the operator that CUDA graphs may replay only where its plan depends on shapes alone.

CUDA graphs themselves run in the GPU lane (tests/gpu/test_cuda_graphs.py); here Dynamo's
graphs run through aot_eager on the CPU, and a backend of this file's lists their operators.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import maskc.integrations.transformers as maskc_hf  # noqa: E402
from maskc.runtime import ops  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
            tie_word_embeddings=False)
_RECORDED: list[str] = []


@torch._dynamo.register_backend
def _maskc_ops_listed(gm, example_inputs, **options):
    """aot_eager, after noting the maskc operators of each graph (transformers passes a mode,
    which only Inductor reads)."""
    _RECORDED.extend(str(node.target) for node in gm.graph.nodes if "maskc" in str(node.target))
    return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)


@pytest.fixture(scope="module")
def llama():
    maskc_hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="maskc")
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval()


def _generate(model, ids, mask):
    config = transformers.CompileConfig(backend="_maskc_ops_listed")
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    torch._dynamo.reset()
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                          cache_implementation="static", compile_config=config)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_compiled_static_generate_matches_sdpa(llama, padded):
    ids = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    _RECORDED.clear()
    ours = _generate(llama[0], ids, mask)
    recorded = set(_RECORDED)
    assert torch.equal(ours, _generate(llama[1], ids, mask))
    # the steps' causal mask captures nothing without padding: its plan depends on shapes alone;
    # padding is a captured tensor, read by the operator that runs outside CUDA graphs
    assert recorded == ({"maskc.decode"} if padded else {"maskc.decode_replayable"})


@pytest.mark.skipif(not ops._PYTHON_EACH_CALL, reason="custom_op takes tags from torch 2.8")
def test_operators_that_read_python_state_stay_out_of_cuda_graphs():
    unsafe = torch.Tag.cudagraph_unsafe
    for name in ("attention", "attention_backward", "decode", "paged_attention"):
        assert unsafe in getattr(torch.ops.maskc, name).default.tags, name
    assert unsafe not in torch.ops.maskc.decode_replayable.default.tags
