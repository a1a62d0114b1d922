"""CUDA-graph capture: building what a replayed graph reads outside the graph's memory pool.

torch.compile's `mode="reduce-overhead"` (CUDA-graph trees, which transformers' static-cache
generate() uses) runs a compiled region once eagerly and then records it, with every
allocation of the recording thread routed to the graphs' private pool. The pool must hold
nothing but the graphs' outputs when a recording ends: a plan or block map that a call caches
there fails that check ("tensor(s) in the cudagraph pool not tracked as outputs"), and its memory
would be handed to the next graph while the cache still read it.

So a plan that a replayed graph reads is built by another thread, whose allocations the
caching allocator serves from its ordinary pools, on a stream of its own that first waits for
the caller's work; the caller waits for the build to finish. A plan cannot be built while a
stream is capturing: its kernels and host reads would be recorded into the graph, or refused.
"""
from __future__ import annotations

import threading

import torch

from maskc.errors import MaskcError


def refuse_capture(device: torch.device) -> None:
    """Refuse to build a plan while the current stream captures a CUDA graph: called where a
    call finds no plan, whose build launches kernels and reads their results on the host."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise MaskcError("a maskc call met its first run inside CUDA-graph capture, where its plan (block map and "
                         "kernel tables) cannot be built: the build's kernels and host reads would be recorded or "
                         "refused; call it once with the same shapes, mask and values before capturing "
                         "(torch.cuda.graph), or let torch.compile's mode='reduce-overhead' warm it up as it does "
                         "on its first call")


def outside_graph_pool(build, device: torch.device):
    """build(), with its CUDA allocations outside any CUDA-graph pool the calling thread
    allocates to (its result may outlive the graph's recording); for CPU tensors, build()."""
    if device.type != "cuda":
        return build()
    refuse_capture(device)
    caller, grad = torch.cuda.current_stream(device), torch.is_grad_enabled()
    done: dict = {}

    def work():
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(caller)
            with torch.cuda.device(device), torch.cuda.stream(side), torch.set_grad_enabled(grad):
                done["value"] = build()
            side.synchronize()
        except BaseException as error:  # raised again in the caller's thread
            done["error"] = error

    worker = threading.Thread(target=work, name="maskc-plan")
    worker.start()
    worker.join()
    if "error" in done:
        raise done["error"]
    return done["value"]


__all__ = ["outside_graph_pool", "refuse_capture"]
