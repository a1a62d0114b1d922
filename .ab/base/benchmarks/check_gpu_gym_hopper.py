"""attention-gym's masks and score mods, as the package ships them, through the Gluon Hopper
kernels (forward and dK/dV, with dQ in the kernel at D=64) against the float64 reference.

    PYTHONPATH=$PWD/.site bash benchmarks/run_gpu.sh benchmarks/check_gpu_gym_hopper.py [1/4] [--only natten,alibi]

tests/test_compat.py runs every attention-gym mod on the CPU, and check_gpu_compat.py compiled,
at 40 queries and 56 keys: under the Gluon kernels' smallest extents (64 queries, 128 keys), so
there they run the Triton-language kernels. Here each builder gets sizes of a few hundred
tokens instead, chosen as the compat cases' are (document lengths summing to the key length,
canvases whose cells are the keys), ragged against the 128-key tiles in some cases and not in
others. Each case runs at D=64 and 128, bfloat16 (or --dtype float16), with MASKC_GLUON=always,
and check_gpu_hopper's `check` asserts that the Gluon kernels ran. `.site` holds attn_gym where the GPU machine has
no package index (`pip install --no-deps --target .site attn-gym`). Exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attn_gym.masks as M  # noqa: E402
import attn_gym.masks.vsa as vsa  # noqa: E402
import attn_gym.mods as MOD  # noqa: E402
from attn_gym.masks.document_mask import length_to_offsets  # noqa: E402
from torch.nn.attention.flex_attention import noop_mask  # noqa: E402

import check_gpu_compat  # noqa: E402
import check_gpu_hopper  # noqa: E402

H = 2


def _graphormer_spatial(N):
    adjacency, _ = check_gpu_compat.compat._graph(2, N)  # test_compat's graph, at N nodes
    distances = MOD.shortest_path_distances(adjacency, max_distance=4).cuda()
    return MOD.generate_graphormer_spatial_bias(torch.randn(H, 6, device="cuda"), distances)


def _graphormer_edge(N):
    adjacency, edge_types = check_gpu_compat.compat._graph(2, N)
    path_edge_types, path_lengths = MOD.shortest_path_edge_types(adjacency, edge_types, max_path_len=2)
    return MOD.generate_graphormer_edge_bias(torch.randn(H, 2, 3, device="cuda"), path_edge_types.cuda(),
                                             path_lengths.cuda())


def _global_sliding(N):
    is_global = torch.zeros(N, dtype=torch.bool, device="cuda")
    is_global[[0, 130, 257]] = True
    return M.generate_global_sliding_window(40, is_global)


def _jetspec_tree(Lq, Lkv):
    parents = [-1] + [(i - 1) // 2 for i in range(1, Lq)]  # a binary tree
    return M.generate_jetspec_tree_causal_mask_mod(Lkv - Lq, M.build_tree_ancestor_matrix(parents, "cuda"))


def offsets(*lengths):
    return length_to_offsets(list(lengths), "cuda")


# (id, B, Lq, Lkv, build -> (mask_mod, score_mod)); 384 keys fill three tiles, 448 do not
CASES = [
    ("causal_mask", 1, 384, 384, lambda: (M.causal_mask, None)),
    ("sliding_window", 1, 448, 448, lambda: (M.generate_sliding_window(100), None)),
    ("prefix_lm", 1, 448, 448, lambda: (M.generate_prefix_lm_mask(130), None)),
    ("doc_mask-causal", 1, 384, 384, lambda: (M.generate_doc_mask_mod(M.causal_mask, offsets(70, 150, 60, 104)), None)),
    ("doc_mask-noop", 1, 448, 448, lambda: (M.generate_doc_mask_mod(noop_mask, offsets(200, 8, 140, 100)), None)),
    ("packed_causal_doc_mask", 1, 384, 384,
     lambda: (M.generate_packed_causal_doc_mask_mod(offsets(70, 150, 60, 104)), None)),
    ("dilated_sliding_window", 1, 448, 448, lambda: (M.generate_dilated_sliding_window(96, 3), None)),
    ("natten", 1, 384, 384, lambda: (M.generate_natten(canvas_w=16, canvas_h=24, kernel_w=5, kernel_h=5), None)),
    ("tiled_natten", 1, 256, 256, lambda: (M.generate_tiled_natten(W=16, H=16, K_W=5, K_H=5, T_W=4, T_H=4), None)),
    ("morton_natten", 1, 256, 256,
     lambda: (M.generate_morton_natten(canvas_w=16, canvas_h=16, kernel_w=5, kernel_h=5), None)),
    ("sta_2d", 1, 448, 448, lambda: (M.generate_sta_mask_mod_2d((16, 24), (8, 8), (4, 4), text_seq_len=64), None)),
    ("sta_3d", 1, 448, 448,
     lambda: (M.generate_sta_mask_mod_3d((4, 8, 12), (2, 4, 8), (2, 4, 4), text_seq_len=64), None)),
    ("svg_spatial_head", 1, 384, 384,
     lambda: (M.generate_spatial_head_mask_mod(64, 5, 64, width=1, round_width=32), None)),
    ("svg_spatial_head-attn_sink", 1, 384, 384,
     lambda: (M.generate_spatial_head_mask_mod(64, 5, 64, width=1, attn_sink=True, round_width=32), None)),
    ("svg_temporal_head", 1, 384, 384, lambda: (M.generate_temporal_head_mask_mod(64, 5, 64, width=2), None)),
    ("flamingo_vision_cross_attention", 1, 256, 384, lambda: (M.generate_vision_cross_attention_mask_mod(
        torch.tensor([[0, 80], [60, 170], [150, 256], [200, 256]], device="cuda"), image_token_length=96), None)),
    ("global_sliding_window", 1, 384, 384, lambda: (_global_sliding(384), None)),
    ("shared_prefix", 1, 448, 448, lambda: (M.generate_shared_prefix_mask_mod(
        offsets(100, 60, 90, 120, 78), torch.tensor([0, 0, 0, 3, 3], dtype=torch.int32, device="cuda")), None)),
    ("block_diffusion", 1, 384, 384, lambda: (M.generate_block_diffusion_mask(192, 40), None)),
    ("jetspec_tree_causal", 1, 128, 448, lambda: (_jetspec_tree(128, 448), None)),
    ("jetspec_training", 1, 128, 384, lambda: (M.generate_jetspec_training_mask_mod(256, 32), None)),
    ("batchify-causal", 1, 384, 384, lambda: (M.batchify_mask_mod(M.causal_mask, 96), None)),
    ("vsa_padding", 1, 384, 384, lambda: (vsa.generate_vsa_padding_mask_mod(
        torch.tensor([64, 40, 64, 17, 64, 50], device="cuda"), 64), None)),
    ("alibi", 1, 448, 448, lambda: (None, MOD.generate_alibi_bias(H))),
    ("tanh_softcap", 1, 384, 384, lambda: (None, MOD.generate_tanh_softcap(2))),
    ("activation-gelu", 1, 384, 384, lambda: (None, MOD.generate_activation_score_mod())),
    ("sandwich", 1, 448, 448, lambda: (None, MOD.generate_sandwich_bias(H, 448, d_bar=16))),
    ("graphormer_spatial", 2, 384, 384, lambda: (None, _graphormer_spatial(384))),
    ("graphormer_edge", 2, 256, 256, lambda: (None, _graphormer_edge(256))),
    ("causal+alibi", 1, 384, 384, lambda: (M.causal_mask, MOD.generate_alibi_bias(H))),
    ("sliding_window+tanh_softcap", 1, 448, 448,
     lambda: (M.generate_sliding_window(100), MOD.generate_tanh_softcap(2))),
]


def main():
    os.environ["MASKC_GLUON"] = "always"  # wherever the Gluon kernels can run
    parser = argparse.ArgumentParser()
    parser.add_argument("shard", nargs="?", default="1/1", help="i/n: every n-th case from the i-th")
    parser.add_argument("--only", default="", help="case names, separated by commas")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    shard, shards = map(int, args.shard.split("/"))
    dtype = getattr(torch, args.dtype)
    failures = ran = 0
    for name, B, Lq, Lkv, build in CASES[shard - 1::shards]:
        if args.only and name not in args.only.split(","):
            continue
        torch.manual_seed(0)
        # tensors a builder made on the CPU (sandwich's table) go beside q, as a user's would
        mask, score = (check_gpu_compat.to_cuda(m) for m in build())
        for D in (64, 128):
            q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype)
            k, v = (torch.randn(B, H, Lkv, D, device="cuda", dtype=dtype) for _ in range(2))
            failures += check_gpu_hopper.check(f"gym-{name:32s} B={B} Lq={Lq} Lkv={Lkv} D={D} {args.dtype}", q, k, v,
                                               mask, score)
            ran += 1
    print(f"shard {shard}/{shards}: {failures} failures of {ran} runs")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
