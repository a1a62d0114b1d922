"""Tokens per second of transformers' generate() on a 1B Llama with maskc, SDPA and FlexAttention as
its attention: eager with the dynamic cache, and with the static cache, whose forward transformers
compiles (torch.compile, mode reduce-overhead: CUDA graphs).

    bash benchmarks/run_gpu.sh benchmarks/bench_generate.py                    # batch 1, 16, 64; eager and static
    bash benchmarks/run_gpu.sh benchmarks/bench_generate.py --modes static --batches 1,16 --impls maskc,sdpa
    python benchmarks/bench_generate.py --smoke        # CPU, a tiny model: the script end to end

The model is transformers' LlamaForCausalLM with Llama 3.2 1B's shapes (16 layers, hidden 2048, 32
query and 8 kv heads of dim 64, MLP 8192, vocabulary 128256), random weights (seed 0), bf16, with
untied embeddings: with tied random ones the greedy token mostly repeats the input token whatever
attention computes, and comparing tokens would test nothing. The prompt is 512 random tokens,
followed by 64 greedy tokens (min_new_tokens = max_new_tokens). A row's time is the median of three
synchronised generate() calls after one that compiles and captures; tok/s = batch × new tokens ÷
that time, the prompt's prefill included.

Eager rows run in this process, every implementation with the same weights. Each static row runs
in its own process (the script calls itself with --only impl,batch,static): the CUDA-graph pools of
two compiled models in one process collide. The seed gives every process the same weights, which
each row's weight checksum confirms. Before timing, each row's greedy tokens (from the call that
compiles) are compared with SDPA's in the same mode and batch: the table counts the equal ones. A
row that raises shows the exception's last line and the run goes on.

--smoke runs the same code on the CPU in float32 with a two-layer model and a few tokens: a check
of the script, not a measurement (on the CPU transformers does not compile the static cache's
forward, and maskc runs through Triton's interpreter).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import transformers

import maskc.integrations.transformers
from _results import JSON_HELP, Figure, write

CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=16384,
              rope_theta=500000.0, tie_word_embeddings=False, attention_dropout=0.0)
SMOKE_CONFIG = dict(CONFIG, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
FULL = dict(device="cuda", dtype=torch.bfloat16, config=CONFIG, batches="1,16,64", prompt=512, tokens=64)
SMOKE = dict(device="cpu", dtype=torch.float32, config=SMOKE_CONFIG, batches="2", prompt=16, tokens=4)
NAMES = {"maskc": "maskc", "sdpa": "SDPA", "flex_attention": "FlexAttention", "eager": "eager"}
REFERENCE = "sdpa"
ROW_TAG = "#row "  # marks the JSON line a child process prints for its row
CHILD_TIMEOUT_S = 1800  # a bound for a static row's process that hangs: the row is reported as failed
FIGURES: list[Figure] = []  # every printed figure, for --json


@dataclass
class Row:
    """One (mode, batch, implementation): its throughput, or the error that stopped it."""

    mode: str
    batch: int
    impl: str
    tok_s: float | None = None
    tokens: list | None = None  # the new tokens, [batch][new]
    checksum: float | None = None  # sum of every weight, to show that processes built the same model
    error: str | None = None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: str, repeats: int = 3) -> float:
    """Median seconds of fn() over `repeats` synchronised runs (the caller has run it once already)."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def last_line(error: BaseException) -> str:
    """The line a traceback ends with: the exception's type and its message's last line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}".strip()


def checksum(model) -> float:
    return sum(p.detach().sum(dtype=torch.float64).item() for p in model.parameters())


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompt_ids(setup: dict, batch: int, prompt: int) -> torch.Tensor:
    return torch.randint(0, setup["config"]["vocab_size"], (batch, prompt), device=setup["device"],
                         generator=torch.Generator(setup["device"]).manual_seed(1))


def generate_timed(model, ids: torch.Tensor, new: int, device: str, **options) -> tuple[float, torch.Tensor]:
    """(median seconds of a greedy generate() of `new` tokens, the new tokens of the first call, which
    compiles and captures and is not timed)."""
    def run():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, **options)

    with torch.no_grad():
        tokens = run()[:, ids.shape[1]:].cpu()
        return median_seconds(run, device), tokens


def model_for(impl: str, setup: dict, state=None):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**setup["config"])
    with torch.device(setup["device"]):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=setup["dtype"])
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def measure(model, row: Row, setup: dict, prompt: int, new: int) -> Row:
    """Fill `row` with its tok/s and tokens, or with the exception that stopped it."""
    options = {"cache_implementation": "static"} if row.mode == "static" else {}
    try:
        row.checksum = checksum(model)
        seconds, tokens = generate_timed(model, prompt_ids(setup, row.batch, prompt), new, setup["device"], **options)
        row.tok_s, row.tokens = row.batch * new / seconds, tokens.tolist()
    except Exception as error:  # a failed row is reported in the table and the others go on
        row.error = last_line(error)
        traceback.print_exc()  # the whole story on stderr (a static row's process: relayed by its parent)
    return row


def eager_rows(impls, batches, setup: dict, prompt: int, new: int) -> list[Row]:
    rows = []
    state = None
    for impl in impls:
        try:
            model = model_for(impl, setup, state)
        except Exception as error:
            for batch in batches:
                rows.append(Row("eager", batch, impl, error=last_line(error)))
                progress(rows[-1], rows)
            continue
        if state is None:
            state = model.state_dict()
        for batch in batches:
            rows.append(measure(model, Row("eager", batch, impl), setup, prompt, new))
            progress(rows[-1], rows)
        del model
        free_memory()
        torch._dynamo.reset()
    return rows


def static_row_in_child(impl: str, batch: int, args) -> Row:
    """The static row run by this script in a new process, which prints it as one JSON line."""
    command = [sys.executable, os.path.abspath(__file__), "--only", f"{impl},{batch},static",
               "--prompt", str(args.prompt), "--tokens", str(args.tokens)] + (["--smoke"] if args.smoke else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return Row("static", batch, impl, error=f"its process ran past {CHILD_TIMEOUT_S} s")
    rows = [Row(**json.loads(line[len(ROW_TAG):])) for line in done.stdout.splitlines() if line.startswith(ROW_TAG)]
    if rows and (rows[0].error is None or not done.stderr.strip()):
        return rows[0]
    print(f"  the process for {impl}, batch {batch}, static (exit status {done.returncode}): its stderr ends\n"
          + "\n".join(done.stderr.strip().splitlines()[-30:]), file=sys.stderr, flush=True)
    if rows:
        return rows[0]
    # no row printed: the process died (a crash, a CUDA abort); its stderr's last line says how
    tail = [line for line in done.stderr.splitlines() if line.strip()]
    return Row("static", batch, impl, error=tail[-1].strip() if tail else f"exit status {done.returncode}")


def run_only(only: str, setup: dict, prompt: int, new: int) -> None:
    """--only impl,batch,mode: one row in this process, printed as a JSON line for the parent."""
    impl, batch, mode = only.split(",")
    row = Row(mode, int(batch), impl)
    try:
        model = model_for(impl, setup)
    except Exception as error:
        row.error = last_line(error)
    else:
        measure(model, row, setup, prompt, new)
    print(ROW_TAG + json.dumps(asdict(row)), flush=True)


def reference_of(row: Row, rows: list[Row]) -> Row | None:
    return next((r for r in rows if (r.mode, r.batch, r.impl) == (row.mode, row.batch, REFERENCE)), None)


def equal_tokens(row: Row, rows: list[Row]) -> str:
    ref = reference_of(row, rows)
    if row.tokens is None or ref is None or ref.tokens is None:
        return "—"
    if not math.isclose(ref.checksum, row.checksum, rel_tol=1e-9):  # sums over the same weights in another order
        return f"weights differ from {NAMES[REFERENCE]}'s"
    mine, theirs = torch.tensor(row.tokens), torch.tensor(ref.tokens)
    return f"{(mine == theirs).sum().item()}/{mine.numel()}"


def ratio(row: Row, rows: list[Row]) -> str:
    ref = reference_of(row, rows)
    return f"{row.tok_s / ref.tok_s:.2f}" if row.tok_s and ref is not None and ref.tok_s else "—"


def progress(row: Row, rows: list[Row]) -> None:
    what = f"{row.tok_s:9.1f} tok/s  tokens equal to {NAMES[REFERENCE]}'s: {equal_tokens(row, rows)}" \
        if row.error is None else f"fails: {row.error}"
    print(f"  {row.mode:<6} batch {row.batch:<3} {NAMES.get(row.impl, row.impl):<14} {what}", flush=True)


def table(rows: list[Row], prompt: int, new: int) -> None:
    print(f"\ngenerate(): prompt {prompt}, {new} new tokens, greedy; tok/s and the ratio to "
          f"{NAMES[REFERENCE]}'s (higher is better)")
    print(f"{'mode':<7} {'batch':>5}  {'implementation':<14} {'tok/s':>9} {'÷ ' + NAMES[REFERENCE]:>7}  "
          f"tokens equal to {NAMES[REFERENCE]}'s")
    for row in sorted(rows, key=lambda r: (r.mode, r.batch)):
        head = f"{row.mode:<7} {row.batch:>5}  {NAMES.get(row.impl, row.impl):<14} "
        if row.error is not None:
            print(head + f"fails: {row.error}")
            continue
        print(head + f"{row.tok_s:9.1f} {ratio(row, rows):>7}  {equal_tokens(row, rows)}")
        FIGURES.append(Figure(f"generate(), {row.mode}, batch {row.batch}", NAMES.get(row.impl, row.impl), "throughput",
                              row.tok_s, "tok/s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="maskc,sdpa,flex_attention")
    parser.add_argument("--batches", help=f"default {FULL['batches']} ({SMOKE['batches']} with --smoke)")
    parser.add_argument("--modes", default="eager,static")
    parser.add_argument("--tokens", type=int,
                        help=f"new tokens, default {FULL['tokens']} ({SMOKE['tokens']} with --smoke)")
    parser.add_argument("--prompt", type=int, help=f"default {FULL['prompt']} ({SMOKE['prompt']} with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="a tiny float32 model on the CPU: checks the script")
    parser.add_argument("--only", metavar="IMPL,BATCH,MODE", help="run one row and print it as a JSON line "
                        "(how the script runs each static row in its own process)")
    parser.add_argument("--json", metavar="PATH", help=JSON_HELP)
    args = parser.parse_args()
    setup = SMOKE if args.smoke else FULL
    args.prompt = args.prompt or setup["prompt"]
    args.tokens = args.tokens or setup["tokens"]
    maskc.integrations.transformers.register()
    torch._dynamo.config.cache_size_limit = 64
    if args.only:
        run_only(args.only, setup, args.prompt, args.tokens)
        return
    # the reference runs first, so that each row's progress line can compare its tokens
    impls = sorted(args.impls.split(","), key=lambda impl: impl != REFERENCE)
    batches = [int(b) for b in (args.batches or setup["batches"]).split(",")]
    modes = args.modes.split(",")
    device = torch.cuda.get_device_name() if setup["device"] == "cuda" else "CPU (smoke: not a measurement)"
    print(f"{device}, torch {torch.__version__}, transformers {transformers.__version__}")
    rows = eager_rows(impls, batches, setup, args.prompt, args.tokens) if "eager" in modes else []
    if "static" in modes:
        for impl in impls:
            for batch in batches:
                rows.append(static_row_in_child(impl, batch, args))
                progress(rows[-1], rows)
    table(rows, args.prompt, args.tokens)
    shape = "a tiny Llama on the CPU, float32 (smoke)" if args.smoke else \
        "Llama 3.2 1B's shapes, untied embeddings, bf16"
    write(args.json, "generate", "A 1B Llama: generate() tokens per second",
          f"{shape}, random weights; prompt {args.prompt}, {args.tokens} new tokens, greedy; "
          f"transformers {transformers.__version__}", FIGURES)


if __name__ == "__main__":
    main()
