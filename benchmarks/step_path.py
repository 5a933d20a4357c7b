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

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import random_llama_dir, random_prompts

SKIP = ("cbrun.engine.model", "cbrun.kernels", "cbrun.engine.worker.graph_emulation")
VALUES = {"cbrun.engine.core.plan", "cbrun.engine.sampling_params", "cbrun.engine.worker.device"}

KINDS = {
    "greedy": SamplingParams(max_new_tokens=40),
    "sampled, top_p": SamplingParams(max_new_tokens=40, temperature=0.6, top_p=0.9, seed=1),
    "penalised": SamplingParams(max_new_tokens=40, repetition_penalty=1.2),
    "sampled + logprobs": SamplingParams(max_new_tokens=40, temperature=0.6, top_p=0.9, logprobs=2, seed=1),
}


def trace(params: SamplingParams, speculative: str) -> list[str]:
    """The modules entered, in order (consecutive calls in one module collapsed), during one steady step."""
    config = EngineConfig(
        page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8, speculative=speculative
    )
    engine = LLMEngine.from_pretrained(str(random_llama_dir(128)), config)
    for i, prompt in enumerate(random_prompts(4, 128, 8, 16, seed=3)):
        engine.add_request(i, prompt * 2, params)
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
    for name, params in KINDS.items():
        for speculative in ("off", "ngram"):
            path = trace(params, speculative)
            distinct = list(dict.fromkeys(path))
            names = " > ".join(m.removeprefix("cbrun.engine.") for m in distinct)
            print(f"| {name} | {speculative} | {len(distinct)} | {len(path) - len(distinct)} | {names} |")


if __name__ == "__main__":
    main()
