"""Which modules a step's logits pass through on their way to the scheduler (issue 39's "at most 5 modules").

One engine step per row kind is traced with ``sys.setprofile``: every call into a ``cbrun.engine`` module from the
moment the forward pass returns its logits until the scheduler's ``update_from_output`` is entered (the forward
pass, the kernels and the graph emulation are not counted). Printed per kind: the modules in the order first
entered, how many, and how many times the path came back to a module it had left. Plain-value modules (the plan's
dataclasses, ``SamplingParams``' properties, ``worker.device.to_device``) are listed apart: they hold values, they
do not handle the step.

    PYTHONPATH=. python -m benchmarks.step_path
"""

from __future__ import annotations

import sys
import tempfile
from functools import cache
from pathlib import Path

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.structured_output.params import StructuredOutputsParams
from tests.model_utils import random_llama_dir, random_prompts

SKIP = ("cbrun.engine.model", "cbrun.kernels", "cbrun.engine.worker.graph_emulation")
VALUES = {"cbrun.engine.core.plan", "cbrun.engine.sampling_params", "cbrun.engine.worker.device"}

KINDS = {
    "greedy": SamplingParams(max_new_tokens=40),
    "sampled, top_p": SamplingParams(max_new_tokens=40, temperature=0.6, top_p=0.9, seed=1),
    "penalised": SamplingParams(max_new_tokens=40, repetition_penalty=1.2),
    "sampled + logprobs": SamplingParams(max_new_tokens=40, temperature=0.6, top_p=0.9, logprobs=2, seed=1),
}
#: Constrained kinds (a grammar needs a tokenizer: the demo model's); their requests never run with a token pending.
REGEX = r"[a-c]{2,5}-\d{2}[a-c]{30}"
CONSTRAINED = {
    "constrained": SamplingParams(max_new_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX)),
    "constrained, sampled": SamplingParams(
        max_new_tokens=40, temperature=0.9, seed=3, structured_outputs=StructuredOutputsParams(regex=REGEX)
    ),
}


@cache
def demo_model_dir() -> Path:
    from cbrun.jobs.cli.demo import build_demo_model

    return build_demo_model(Path(tempfile.mkdtemp(prefix="step-path-")) / "model", max_position_embeddings=512)


def trace(params: SamplingParams, speculative: str) -> list[str]:
    """The modules entered, in order (consecutive calls in one module collapsed), during one steady step."""
    config = EngineConfig(
        page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8, speculative=speculative
    )
    constrained = params.structured_outputs is not None
    model_dir = demo_model_dir() if constrained else random_llama_dir(128)
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    for i, prompt in enumerate(random_prompts(4, 128, 8, 16, seed=3)):
        engine.add_request(i, prompt * 2, params)
    while constrained and not engine.scheduler.running:  # a constrained request waits for its grammar
        engine.step()
    for _ in range(4):
        engine.step()
    path: list[str] = []
    state = {"on": False}
    forward = engine.model_runner._forward

    def traced_forward(*args):
        logits = forward(*args)
        state["on"] = True
        return logits

    def profile(frame, event, arg):
        if event != "call" or not state["on"]:
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith("cbrun.engine.core.s") and frame.f_code.co_name in ("update_from_output", "resolve"):
            state["on"] = False
            path.append("cbrun.engine.core.scheduler")
            return
        if module in VALUES or not module.startswith("cbrun.engine") or module.startswith(SKIP):
            return
        if not path or path[-1] != module:
            path.append(module)

    engine.model_runner._forward = traced_forward
    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return path


def main() -> None:
    print("| row kind | speculative | modules | returns | modules in the order first entered |")
    print("|---|---|---|---|---|")
    for name, params in {**KINDS, **CONSTRAINED}.items():
        for speculative in ("off", "ngram") if name in KINDS else ("off",):
            path = trace(params, speculative)
            distinct = list(dict.fromkeys(path))
            names = " > ".join(m.removeprefix("cbrun.engine.") for m in distinct)
            print(f"| {name} | {speculative} | {len(distinct)} | {len(path) - len(distinct)} | {names} |")


if __name__ == "__main__":
    main()
