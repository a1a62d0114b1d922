"""Greedy generation from a paged KV cache, checked against recomputing every sequence.

A small randomly initialised transformer (rotary positions, grouped-query attention, a
sliding-window layer beside a causal one) serves three prompts of different lengths:

1. prefill: each prompt's keys and values are appended to one maskc.PagedKVCache per layer,
   and its queries attend with maskc.paged_attention (the queries are the last Lq tokens);
2. decode: each step appends one token per sequence and attends with the same masks, which
   see logical positions, so masks.causal needs no offset;
3. check: after every step, each sequence's logits match a forward pass over the whole
   sequence with maskc.compiled_attention.

    python examples/generate.py          # CPU (Triton's interpreter, float32) or CUDA (bf16)
"""
from __future__ import annotations

import sys

import torch
from torch import nn

import maskc

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM = 101, 128, 8, 2, 16
LAYER_MASKS = (maskc.masks.causal, maskc.masks.sliding_window(6))  # one per layer
PAGE_SIZE, STEPS = 16, 8


def rotate(x, positions):
    """Rotary embedding of x [B, H, L, D] at integer positions [B, L]."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions[:, None, :, None].float() * freq
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, mask_mod):
        super().__init__()
        self.mask_mod = mask_mod
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def project(self, x, positions):
        B, L, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, L, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(h).view(B, L, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        return rotate(q, positions), rotate(k, positions), v

    def finish(self, x, attended):
        B, _, L, _ = attended.shape
        x = x + self.out(attended.transpose(1, 2).reshape(B, L, HEADS * HEAD_DIM))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer(m) for m in LAYER_MASKS)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def full(self, tokens):
        """Logits of every position of one whole sequence [1, L], recomputed from scratch."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        x = self.embed(tokens)
        for layer in self.layers:
            q, k, v = layer.project(x, positions)
            x = layer.finish(x, maskc.compiled_attention(q, k, v, mask_mod=layer.mask_mod, enable_gqa=True))
        return self.head(x)

    def step(self, tokens, positions, caches, seq_ids):
        """Logits of new tokens [B, T] at positions [B, T], appending their keys and values to
        the caches (one per layer) at slots seq_ids."""
        x = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            q, k, v = layer.project(x, positions)
            cache.append(seq_ids, k, v)
            x = layer.finish(x, maskc.paged_attention(q, cache, seq_ids, mask_mod=layer.mask_mod, enable_gqa=True))
        return self.head(x)


@torch.no_grad()
def main() -> int:
    torch.manual_seed(0)
    model = Model().to(DEVICE, DTYPE).eval()
    prompts = [torch.randint(0, VOCAB, (n,), device=DEVICE) for n in (5, 17, 11)]
    caches = [maskc.PagedKVCache(64, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE, max_seqs=4)
              for _ in LAYER_MASKS]
    slots = [3, 0, 1]  # any free slots of the caches
    sequences, last = [], []
    for slot, prompt in zip(slots, prompts):  # prefill, one prompt at a time (their lengths differ)
        ids = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
        logits = model.step(prompt[None], torch.arange(len(prompt), device=DEVICE)[None], caches, ids)
        sequences.append(prompt.tolist())
        last.append(logits[0, -1])
    seq_ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    tolerance = 5e-2 if DTYPE == torch.bfloat16 else 1e-4
    worst = 0.0
    for step in range(STEPS):
        for seq, logits in zip(sequences, last):
            seq.append(int(logits.argmax()))
        tokens = torch.tensor([[s[-1]] for s in sequences], device=DEVICE)
        positions = torch.tensor([[len(s) - 1] for s in sequences], device=DEVICE)
        logits = model.step(tokens, positions, caches, seq_ids)  # all sequences in one batch
        last = list(logits[:, -1])
        for seq, got in zip(sequences, last):
            want = model.full(torch.tensor([seq], device=DEVICE))[0, -1]
            error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            worst = max(worst, error)
            if error > tolerance:
                print(f"step {step}: paged logits differ from recomputing the sequence by {error:.2e}")
                return 1
    for n, seq in enumerate(sequences):
        print(f"sequence {n}: prompt {len(prompts[n])} tokens, then {seq[len(prompts[n]):]}")
    print(f"{STEPS} steps on {DEVICE} ({DTYPE}): logits match recomputing each sequence "
          f"(worst relative error {worst:.1e}) ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
