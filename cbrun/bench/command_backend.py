"""``cbrun bench``'s ``cbrun-command`` backend: the whole ``cbrun run`` command, default settings, timed from process
start to exit.

What a user gets without tuning: the workload's prompt ids are written to a Parquet file and one flags-only command
runs them, in a fresh process with this checkout's code::

    python -m cbrun.jobs.cli run --model M --input prompts.parquet --prompt-ids-column prompt_token_ids --output OUT \
        --max-new-tokens N --no-progress [--set sampling.stop_token_ids=[...]] [--set sampling.ignore_eos=true]

No thread, budget or cache setting is passed (``--threads`` does not apply): the engine's defaults choose them.
Its time includes interpreter start, imports, model loading, cache allocation, reading the input and writing the
parts; its generation phase alone, the job's own time (``run_job``, from the manifest to the summary) and peak memory
come from the job's ``_cbrun/stats.json`` (``info``), so the report splits the wall time into generation, the
job's setup and finish around it, and the rest (interpreter start, imports before the job, exit).

The command takes one ``--max-new-tokens`` for every row, and the engine caps each row at the model's length, so
the backend runs only workloads whose per-row limits are ``min(N, max_model_len - prompt)`` for one N
(``gsm8k-long``); on others it is skipped with that reason (``command_skip_reason``).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cbrun.bench.measure import RunResult
from cbrun.bench.workloads import Workload, cut_output

#: The checkout whose ``cbrun.jobs.cli`` runs (this one).
REPO = Path(__file__).resolve().parents[2]
PROMPT_IDS_COLUMN = "prompt_token_ids"


def command_skip_reason(workload: Workload) -> str | None:
    """Why the whole command cannot run ``workload`` as the other backends do (None when it can)."""
    limit = max(workload.max_new_tokens)
    expected = [min(limit, workload.max_model_len - len(p)) for p in workload.prompts]
    if expected != list(workload.max_new_tokens):
        return (
            f"cbrun run takes one --max-new-tokens for every row; workload {workload.name} draws a limit per "
            f"row (run it on gsm8k-long)"
        )
    return None


def run_command_line(
    model_dir: Path,
    input_path: Path,
    output_dir: Path,
    max_new_tokens: int,
    prompt: tuple[str, str] = ("--prompt-ids-column", PROMPT_IDS_COLUMN),
    sets: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """A flags-only ``cbrun run`` command (``python -m cbrun.jobs.cli run``, without a progress bar).

    Args:
        prompt: the flag naming the input's prompt column and its value (default: the prompt ids column).
        sets: ``SECTION.KEY=VALUE`` assignments, each passed as ``--set``.
    """
    command = [sys.executable, "-m", "cbrun.jobs.cli", "run", "--model", str(model_dir), "--input", str(input_path)]
    command += [*prompt, "--output", str(output_dir), "--max-new-tokens", str(max_new_tokens), "--no-progress"]
    return command + [a for s in sets for a in ("--set", s)]


def command_line(workload: Workload, input_path: Path, output_dir: Path) -> list[str]:
    """The flags-only ``cbrun run`` command for ``workload``: no engine setting, sampling as the workload says."""
    sets = []
    if workload.stop_token_ids:
        sets.append(f"sampling.stop_token_ids={list(workload.stop_token_ids)}")
    if workload.ignore_eos:
        sets.append("sampling.ignore_eos=true")
    return run_command_line(workload.model_dir, input_path, output_dir, max(workload.max_new_tokens), sets=sets)


def run_command(workload: Workload) -> RunResult:
    """Run the whole command once in a fresh process; outputs read back from its parts in row order.

    Raises:
        RuntimeError: the command failed (its last stderr lines are in the message).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cbrun.jobs.output.output_dir import open_output, read_output

    with tempfile.TemporaryDirectory(prefix="cbrun-bench-command-") as tmp:
        input_path, output_dir = Path(tmp) / "prompts.parquet", Path(tmp) / "out"
        pq.write_table(pa.table({PROMPT_IDS_COLUMN: pa.array(workload.prompts, pa.list_(pa.int32()))}), input_path)
        command = command_line(workload, input_path, output_dir)
        load_before, cpu_before = os.getloadavg()[0], _children_cpu_s()
        start = time.perf_counter()
        # cwd and PYTHONPATH: ``python -m`` then imports this checkout, not an installed cbrun.
        done = subprocess.run(
            command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True
        )
        wall = time.perf_counter() - start
        cpu = _children_cpu_s() - cpu_before
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"cbrun run exited {done.returncode}:\n{tail}")
        table = read_output(output_dir, ["row_index", "completion_token_ids"]).sort_by("row_index")
        stats = open_output(output_dir).read_stats() or {}
    ids = table.column("completion_token_ids").to_pylist()
    outputs = [cut_output(o or [], m, workload.stop_token_ids) for o, m in zip(ids, workload.max_new_tokens)]
    return _command_result(outputs, stats, command, done.stdout, wall, cpu, load_before)


def _command_result(
    outputs: list, stats: dict, command: list[str], stdout: str, wall: float, cpu: float, load_before: float
) -> RunResult:
    """The command's ``RunResult``: its outputs, times and the job's own stats (stats.json)."""
    n = len(outputs)
    info = {
        "generation_s": stats.get("generation_s"),
        "job_elapsed_s": stats.get("elapsed_s"),
        "peak_memory_mib": stats.get("peak_memory_mib"),
        "summary": stdout.strip().splitlines()[-1:],
        "command": "cbrun " + " ".join(command[3:]),
        "peak_rss_method": "the job's own peak_memory_mib (stats.json)",
    }
    return RunResult(
        "cbrun-command",
        "",
        outputs,
        wall,
        cpu,
        [None] * n,
        [None] * n,
        None,
        rss_peak_mib=stats.get("peak_memory_mib"),
        rss_base_mib=0.0,
        load_avg=(load_before, os.getloadavg()[0]),
        info=info,
    )


def _children_cpu_s() -> float:
    """User plus system CPU seconds of this process's finished children (all their threads)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
