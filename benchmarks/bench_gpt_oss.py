"""A gpt-oss-shaped model (transformers' GptOssForCausalLM: sliding-window and full attention layers
in turn, grouped-query attention, attention sinks) with maskc, FlexAttention and transformers' eager
attention side by side in one process: prefill, generate() tokens per second and a training step.

    bash benchmarks/run_gpu.sh benchmarks/bench_gpt_oss.py                         # every section
    bash benchmarks/run_gpu.sh benchmarks/bench_gpt_oss.py --sections generate --impls flex_attention,maskc
    python benchmarks/bench_gpt_oss.py --smoke         # CPU, a tiny model: the script end to end

The model has gpt-oss-20b's attention: 24 layers alternating sliding window 128 and full attention
(sliding first), 64 query and 8 kv heads of dim 64, a learned sink logit per query head, hidden
size 2880, YaRN rope; random weights (seed 0), bf16. Two things differ from gpt-oss-20b, for
memory: 4 experts a layer, each token routed to all 4 (gpt-oss-20b routes each token to 4 of 32,
so a token's expert work is the same with an eighth of the expert weights), and a vocabulary of
32000 (against 201088, whose output layer and loss would take more of the training step than
attention). That makes 3.2B parameters, 6.4 GB in bf16 (2.4B of them the experts'), so that the
training step's gradients and activations fit one 80 GB GPU beside the weights every
implementation shares. By FLOP counts attention is then about an eighth of the prefill's work and
a fourteenth of the training step's: the model's times dilute the attention's ratios.

Sections, each with the same weights for every implementation:
- prefill: the decoder stack's forward (no output layer: generate()'s prefill computes one row of
  logits) at 8192 tokens, batch 1, no grad; time a call;
- generate: generate() at batch 1 and 16, a 512-token random prompt then 64 greedy tokens, eager,
  dynamic cache; tok/s = batch × new tokens ÷ the time, the prompt's prefill included;
- train: forward and backward of the language-model loss at 4096 tokens, batch 1 (no optimizer
  step), the model not compiled (transformers compiles flex_attention itself); time a step.
Each time is the median of three synchronised runs after one untimed run, whose output is compared
with the first implementation's that ran (the prefill's hidden states, the greedy tokens, the loss
and the sinks' gradients). The last column is maskc's speed-up over the row's implementation.
transformers refuses some implementations for gpt-oss (sdpa): their rows say "not supported"; a
row that raises (out of memory, for one) shows the exception's last line, and the run goes on.

--smoke runs the same code on the CPU in float32 with a two-layer model (one sliding window of 8,
one full), 64- and 32-token sequences and a few generated tokens: a check of the script, not a
measurement.
"""
from __future__ import annotations

import argparse
import functools
import traceback
from dataclasses import dataclass

import torch
import transformers

import maskc.integrations.transformers
from _results import JSON_HELP, Figure, write
from bench_generate import free_memory, generate_timed, last_line, median_seconds

CONFIG = dict(vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
              num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
              num_local_experts=4, num_experts_per_tok=4, tie_word_embeddings=False, attention_dropout=0.0)
SMOKE_CONFIG = dict(CONFIG, vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=8,
                    num_local_experts=2, num_experts_per_tok=2)
FULL = dict(device="cuda", dtype=torch.bfloat16, config=CONFIG, prefill=8192, train=4096, batches="1,16",
            prompt=512, tokens=64)
SMOKE = dict(device="cpu", dtype=torch.float32, config=SMOKE_CONFIG, prefill=64, train=32, batches="2",
             prompt=16, tokens=4)
NAMES = {"maskc": "maskc", "eager": "eager", "sdpa": "SDPA", "flex_attention": "FlexAttention"}
SECTIONS = ("prefill", "generate", "train")
FIGURES: list[Figure] = []  # every printed figure, for --json


@dataclass
class Row:
    """One implementation on one workload: its time (ms) or throughput (tok/s), or why it has none."""

    workload: str
    impl: str
    unit: str  # "ms" or "tok/s"
    value: float | None = None
    check: str = ""  # its output against the first implementation's
    error: str | None = None


def model_for(impl: str, setup: dict, state=None):
    torch.manual_seed(0)
    layers = setup["config"]["num_hidden_layers"]
    config = transformers.GptOssConfig(**setup["config"],
                                       layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    with torch.device(setup["device"]):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=setup["dtype"])
    if state is not None:
        model.load_state_dict(state)
    return model


def tokens(setup: dict, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, setup["config"]["vocab_size"], (batch, length), device=setup["device"],
                         generator=torch.Generator(setup["device"]).manual_seed(seed))


def relative(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """max |mine − reference| ÷ max |reference|."""
    return ((mine - reference).abs().max() / reference.abs().max()).item()


class Bench:
    """The sections for each implementation in turn; the first implementation that runs a workload
    gives the outputs the others are compared with."""

    def __init__(self, setup: dict, args):
        self.setup, self.args = setup, args
        self.device = setup["device"]
        self.reference: dict[str, tuple[str, object]] = {}  # workload -> (implementation, its output)
        self.rows: list[Row] = []

    def compare(self, workload: str, impl: str, output, describe) -> str:
        if workload not in self.reference:
            self.reference[workload] = impl, output
            return "(the reference)"
        name, theirs = self.reference[workload]
        return f"{describe(output, theirs)} against {NAMES.get(name, name)}"

    def run(self, workload: str, impl: str, unit: str, fn) -> None:
        """fn() -> (value, check text); an exception becomes the row's error."""
        row = Row(workload, impl, unit)
        try:
            row.value, row.check = fn()
        except Exception as error:  # a failed row is reported in the table and the others go on
            row.error = f"fails: {last_line(error)}"
            traceback.print_exc()  # the whole story on stderr
        free_memory()
        self.rows.append(row)
        what = f"{row.value:10.2f} {unit:<5}  {row.check}" if row.error is None else row.error
        print(f"  {workload:<26} {NAMES.get(impl, impl):<14} {what}", flush=True)

    def prefill(self, model, impl: str) -> None:
        length = self.args.prefill_length
        ids = tokens(self.setup, 1, length, seed=length)

        def measure():
            with torch.no_grad():
                out = model.model(input_ids=ids).last_hidden_state.float()
                check = self.compare("prefill", impl, out,
                                     lambda a, b: f"max |Δ hidden| ÷ max |hidden| {relative(a, b):.2g}")
                del out
                return median_seconds(lambda: model.model(input_ids=ids), self.device) * 1e3, check

        self.run(f"prefill, {length} tokens", impl, "ms", measure)

    def generate(self, model, impl: str) -> None:
        def measure(batch: int):
            ids = tokens(self.setup, batch, self.args.prompt, seed=1)
            seconds, new = generate_timed(model, ids, self.args.tokens, self.device)
            equal = lambda a, b: f"tokens equal {(a == b).sum().item()}/{a.numel()}"
            return batch * self.args.tokens / seconds, self.compare(f"generate {batch}", impl, new, equal)

        for batch in self.args.batches:
            self.run(f"generate(), batch {batch}", impl, "tok/s", functools.partial(measure, batch))

    def train(self, model, impl: str) -> None:
        length = self.args.train_length
        ids = tokens(self.setup, 1, length, seed=length)
        model.train()

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        def measure():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            # a sink left without a gradient counts as a zero one, which the comparison then shows
            sinks = torch.cat([torch.zeros_like(layer.self_attn.sinks).float() if layer.self_attn.sinks.grad is None
                               else layer.self_attn.sinks.grad.float() for layer in model.model.layers])
            check = self.compare("train", impl, (loss.item(), sinks), lambda a, b: (
                f"|Δ loss| {abs(a[0] - b[0]):.2g}, max |Δ sinks' grad| ÷ max |grad| {relative(a[1], b[1]):.2g}"))
            del loss
            model.zero_grad(set_to_none=True)
            return median_seconds(step, self.device) * 1e3, check

        self.run(f"training step, {length} tokens", impl, "ms", measure)
        model.zero_grad(set_to_none=True)  # where a step raised half-way (out of memory)
        model.eval()

    def implementation(self, impl: str, sections, state):
        """Every section for `impl`; returns the weights for the next implementation."""
        try:
            model = model_for(impl, self.setup, state).eval()
        except Exception as error:  # transformers refuses the implementation for this model
            # (its message goes on with a link and an example of from_pretrained: the first sentence says it)
            refusal = f"not supported: {last_line(error).split('. ')[0]}"
            for workload in self.workloads(sections):
                self.rows.append(Row(workload, impl, "", error=refusal))
            print(f"  {NAMES.get(impl, impl):<14} {refusal}", flush=True)
            return state
        state = state if state is not None else model.state_dict()
        for section in sections:
            getattr(self, section)(model, impl)
        del model
        free_memory()
        torch._dynamo.reset()
        return state

    def workloads(self, sections) -> list[str]:
        names = {"prefill": [f"prefill, {self.args.prefill_length} tokens"],
                 "generate": [f"generate(), batch {b}" for b in self.args.batches],
                 "train": [f"training step, {self.args.train_length} tokens"]}
        return [name for section in sections for name in names[section]]

    def table(self, sections) -> None:
        print("\nms (lower is better) or tok/s (higher); maskc's speed-up over each implementation")
        print(f"{'workload':<26} {'implementation':<14} {'value':>10} {'':<5}  {'maskc ×':>7}  output")
        for workload in self.workloads(sections):
            rows = [r for r in self.rows if r.workload == workload]
            mine = next((r.value for r in rows if r.impl == "maskc"), None)
            for row in rows:
                head = f"{workload:<26} {NAMES.get(row.impl, row.impl):<14} "
                if row.error is not None:
                    print(head + row.error)
                    continue
                faster = None if mine is None or row.impl == "maskc" else (
                    row.value / mine if row.unit == "ms" else mine / row.value)
                print(head + f"{row.value:10.2f} {row.unit:<5}  {'—' if faster is None else f'{faster:.2f}':>7}  "
                      f"{row.check}")
                metric = "time" if row.unit == "ms" else "throughput"
                FIGURES.append(Figure(workload, NAMES.get(row.impl, row.impl), metric, row.value, row.unit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="eager,sdpa,flex_attention,maskc",
                        help="the first that runs a workload is the one the others' outputs are compared with")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="any of " + ",".join(SECTIONS))
    parser.add_argument("--prefill-length", type=int,
                        help=f"default {FULL['prefill']} ({SMOKE['prefill']} with --smoke)")
    parser.add_argument("--train-length", type=int, help=f"default {FULL['train']} ({SMOKE['train']} with --smoke)")
    parser.add_argument("--batches", help=f"generate()'s, default {FULL['batches']} ({SMOKE['batches']} with --smoke)")
    parser.add_argument("--prompt", type=int, help=f"default {FULL['prompt']} ({SMOKE['prompt']} with --smoke)")
    parser.add_argument("--tokens", type=int,
                        help=f"new tokens, default {FULL['tokens']} ({SMOKE['tokens']} with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="a tiny float32 model on the CPU: checks the script")
    parser.add_argument("--json", metavar="PATH", help=JSON_HELP)
    args = parser.parse_args()
    setup = SMOKE if args.smoke else FULL
    args.prefill_length = args.prefill_length or setup["prefill"]
    args.train_length = args.train_length or setup["train"]
    args.batches = [int(b) for b in (args.batches or setup["batches"]).split(",")]
    args.prompt = args.prompt or setup["prompt"]
    args.tokens = args.tokens or setup["tokens"]
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections takes {', '.join(SECTIONS)}, got {', '.join(sorted(unknown))}")
    maskc.integrations.transformers.register()
    torch._dynamo.config.cache_size_limit = 64
    device = torch.cuda.get_device_name() if setup["device"] == "cuda" else "CPU (smoke: not a measurement)"
    print(f"{device}, torch {torch.__version__}, transformers {transformers.__version__}")
    bench = Bench(setup, args)
    state = None
    for impl in args.impls.split(","):
        state = bench.implementation(impl, sections, state)
    bench.table(sections)
    shape = "a tiny gpt-oss on the CPU, float32 (smoke)" if args.smoke else \
        ("gpt-oss-20b's attention (24 layers, sliding window 128 and full in turn, 64/8 heads of dim 64, sinks), "
         "4 experts, vocabulary 32000, bf16")
    write(args.json, "gpt_oss", "A gpt-oss-shaped model: prefill, generate(), training step",
          f"{shape}, random weights; transformers {transformers.__version__}", FIGURES)


if __name__ == "__main__":
    main()
