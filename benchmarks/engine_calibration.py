"""The engine model's calibration tables (docs/simulator.md, "The engine"), printed.

    .venv/bin/python benchmarks/engine_calibration.py

For each preset of ``extproc.fleet.engine``: a decode step's time by batch and context, a lone
prompt's time to first token by its length (chunked prefill, the token budget a step), and for
the default preset the inter-token latency a closed loop of 1, 50 and 100 clients measures
with the Azure conversation trace's lengths (``calibration_itl_ms``), beside the published
18.6 / 59.7 / ~93 ms. Pure computation: a few seconds.
"""

from __future__ import annotations

from pathlib import Path

from extproc.fleet.engine import (
    LLAMA_8B_1XH100,
    LLAMA_70B_FP8_2XH100,
    EngineModel,
    Scheduler,
    Sequence,
    calibration_itl_ms,
)
from extproc.sim.workload import read_azure

TRACE = (Path(__file__).resolve().parents[1] / "tests" / "data" / "traces"
         / "azure-llm-2023-conv.csv.gz")
CONTEXTS = (1000, 4000, 16000, 64000)
BATCHES = (1, 16, 64, 256)
PROMPTS = (1000, 8000, 32000, 128000)


def ttft_alone_s(model: EngineModel, prompt: int) -> float:
    sched = Scheduler(model)
    sched.add(Sequence(prompt, 2))
    elapsed = 0.0
    while True:
        step = sched.schedule()
        assert step is not None
        elapsed += step.duration_ms
        if step.seqs[0].computed + step.tokens[0] >= prompt:
            return elapsed / 1000.0
        sched.complete(step)


def main() -> None:
    for name, model in (("llama-70b-fp8-2xh100", LLAMA_70B_FP8_2XH100),
                        ("llama-8b-1xh100", LLAMA_8B_1XH100)):
        print(f"\n{name}: decode step (ms) by batch and context")
        print("| batch \\ context | " + " | ".join(f"{c:,}" for c in CONTEXTS) + " |")
        print("| ---: |" + " ---: |" * len(CONTEXTS))
        for b in BATCHES:
            print(f"| {b} | " + " | ".join(f"{model.itl_ms(b, c):.1f}" for c in CONTEXTS) + " |")
        print("TTFT of a lone prompt: " + ", ".join(
            f"{p:,} tokens {ttft_alone_s(model, p):.2f} s" for p in PROMPTS))
    if TRACE.exists():
        jobs = read_azure(TRACE, max_tokens=1024)[:3000]
        prompts = [j.prompt_tokens for j in jobs]
        outputs = [j.output_tokens for j in jobs]
        for clients, published in ((1, "18.6"), (50, "59.7"), (100, "~93")):
            itl = calibration_itl_ms(LLAMA_70B_FP8_2XH100, clients, prompts, outputs)
            print(f"70B inter-token latency at {clients} clients: {itl:.1f} ms"
                  f" (published {published})")


if __name__ == "__main__":
    main()
