"""The ``cbrun`` command: ``run``, ``status``, ``export``, ``convert-llama2c``, ``demo`` and ``bench``. Thin: the
work is in jobs.run.job, jobs.output.status, jobs.output.export and jobs.cli.demo; ``bench`` is the command the benchmarks package
registers in the ``cbrun.commands`` entry-point group (``COMMAND_ENTRY_POINTS``), so no runtime module imports it.

``main`` parses the command line (``cbrun.jobs.cli.parser``: the commands, their flags and ``EXIT_CODES``, also in
``cbrun --help``, ``cbrun run --help`` and docs/running.md) and runs the command's handler here.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
import traceback

from cbrun.jobs.cli.parser import RUN_FLAGS, parse_command_line

#: The entry-point group through which an installed package adds a ``cbrun`` command (``bench``).
COMMAND_ENTRY_POINTS = "cbrun.commands"


def main(argv: list[str] | None = None) -> int:
    """Run one ``cbrun`` command; returns its exit code (``cbrun.jobs.cli.parser.EXIT_CODES``).

    Args:
        argv: the arguments after the program name; None: this process's own command line (``sys.argv``), and
            then a ``run`` ends the process itself once it is done (``exit_process``) rather than return.
    """
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark parses its own options
        return _bench(argv[1:])
    if argv[:1] == ["lm-eval"]:  # lm-eval parses its own options
        from cbrun.jobs.integrations.lm_eval_backend import main as lm_eval_main

        return lm_eval_main(argv[1:])
    args = parse_command_line(argv)
    _quiet_transformers()
    try:
        if args.command == "run":
            code = _run(args, argv)
            if own_process:
                exit_process(code)  # returns only when the process cannot end at once
            return code
        if args.command == "status":
            return _status(args)
        if args.command == "convert-llama2c":
            return _convert(args)
        if args.command == "export":
            return _export(args)
        if args.command == "report":
            return _report(args)
        if args.command == "compact":
            return _compact(args)
        return _demo(args)
    except KeyboardInterrupt as exc:  # jobs.run.signals.Interrupted: SIGINT or SIGTERM
        signum = getattr(exc, "signum", signal.SIGINT)
        committed = getattr(exc, "num_committed_rows", None)
        done = "" if committed is None else f"; the {committed} output rows this run finished are committed"
        print(
            f"cbrun: interrupted by {signal.Signals(signum).name}: stopped admitting rows{done}; rerun the same "
            f"command to resume",
            file=sys.stderr,
        )
        return 128 + signum


def exit_process(code: int) -> None:
    """End this process now with ``code``, without the interpreter's teardown; return when that is not safe.

    Once ``run`` is done, everything it wrote is closed and in place (parts fsynced and renamed, job files written
    and renamed, the output's lock released); what a process hands the OS survives ``os._exit`` as it survives a
    normal exit. What is left at a normal exit is the teardown of the interpreter, whose final garbage
    collections walk the ~400k objects that torch and transformers create at import: about a second (a tenth of
    the whole command on a short job). This runs what a normal exit runs that anyone can see: the ``atexit``
    handlers (logging's flush, Ray's shutdown, temporary directories' cleanup, ...), then flushes stdout and
    stderr, then ``os._exit``. A normal exit first waits for non-daemon threads, so while one is alive this returns
    and the caller exits normally.
    """
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # NOTE: the same call a normal exit makes (CPython's atexit module)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)


def _bench(argv: list[str]) -> int:
    """``cbrun bench``: the ``bench`` command registered in ``COMMAND_ENTRY_POINTS`` (``cbrun.bench``,
    by pyproject.toml), loaded only now; exit 2 when no installed package registers it."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=COMMAND_ENTRY_POINTS, name="bench"))
    try:
        bench_main = found[0].load() if found else None
    except ImportError as exc:
        print(f"cbrun: error: cbrun bench is registered but does not import: {exc}", file=sys.stderr)
        return 2
    if bench_main is None:
        print(
            "cbrun: error: no installed package registers cbrun bench (the cbrun.commands entry point); "
            "reinstall cbrun, or run python -m cbrun.bench",
            file=sys.stderr,
        )
        return 2
    return bench_main(argv)


def _quiet_transformers() -> None:
    """Keep transformers' per-load progress bars and advisory warnings out of a job's output; show cbrun's own
    log lines (which loader ran, cache size, why CUDA graphs are off, sharing off for sliding-window models).

    Does not import transformers (a job on the safetensors loader never does): when it is not imported yet, its
    import reads the same settings from the environment (``TRANSFORMERS_VERBOSITY``, and huggingface_hub's
    ``HF_HUB_DISABLE_PROGRESS_BARS``, which transformers' progress bars follow); values the user set are kept.
    """
    import logging

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("cbrun").setLevel(logging.INFO)
    if "transformers" not in sys.modules:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from cbrun.jobs.run.heap import collection_paused

    # NOTE: the setup (imports of torch and transformers, loading) runs with the collector paused; run_job turns it
    # back on for generation, with the setup's objects frozen out of its way (jobs.run.heap).
    with collection_paused():
        return _run_job(args, argv)


def _run_job(args: argparse.Namespace, argv: list[str]) -> int:
    from cbrun.jobs.cli.values import cli_text
    from cbrun.jobs.config.manifest import load_manifest
    from cbrun.jobs.run.job import JobAborted, JobError, run_job
    from cbrun.jobs.run.signals import interrupt_on_stop_signals

    overrides: dict[str, dict] = {}
    try:
        for flag, (section, key) in RUN_FLAGS.items():
            overrides.setdefault(section, {})[key] = _flag_value(flag, getattr(args, flag), cli_text)
        manifest = load_manifest(args.manifest, args.sets, overrides)
        with interrupt_on_stop_signals():
            if manifest.cluster.data_parallel_size > 1:  # this process only starts and waits for the replicas
                from cbrun.jobs.run.data_parallel import run_data_parallel

                return run_data_parallel(argv, manifest)
            summary = run_job(manifest, progress=not args.no_progress, retry_errors=args.retry_errors)
    except (JobError, ValueError, FileNotFoundError) as exc:
        return _error(exc, 2)
    except JobAborted as exc:
        traceback.print_exception(exc.__cause__, file=sys.stderr)
        return _error(exc, 1)
    print(summary.line())
    return summary.exit_code


def _flag_value(flag: str, value, cli_text):
    """A flag's value for the manifest: text flags read with TOML's escapes (``cli_text``)."""
    if value is None or flag not in ("template", "stop"):
        return value
    return [cli_text(v) for v in value] if isinstance(value, list) else cli_text(value)


def _export(args: argparse.Namespace) -> int:
    from cbrun.jobs.output.export import ExportError, export

    try:
        path = export(args.output_dir, args.format, args.to)
    except (ExportError, OSError) as exc:
        return _error(exc, 2)
    print(f"cbrun: wrote {path}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from cbrun.jobs.observe.report import write_report

    if args.price_per_hour is not None and not args.price_per_hour >= 0:
        print(f"cbrun: error: --price-per-hour must be >= 0, got {args.price_per_hour}", file=sys.stderr)
        return 2
    try:
        path = write_report(args.output_dir, args.out, args.price_per_hour)
    except (ImportError, ValueError, OSError) as exc:
        return _error(exc, 2)
    print(f"cbrun: wrote {path}")
    return 0


def _error(exc: BaseException, code: int) -> int:
    """Print ``cbrun: error: <exc>`` to stderr; returns the exit code (2: a setup problem, 1: a failure)."""
    print(f"cbrun: error: {exc}", file=sys.stderr)
    return code


def _status(args: argparse.Namespace) -> int:
    from cbrun.jobs.output.status import status_report

    try:
        report, code = status_report(args.output_dir)
    except (ValueError, OSError) as exc:
        return _error(exc, 2)
    print(report)
    return code


def _compact(args: argparse.Namespace) -> int:
    from cbrun.jobs.output.compact import compact_output
    from cbrun.jobs.output.lock import OutputLocked
    from cbrun.jobs.store.files import StorageError

    try:
        result = compact_output(args.output_dir, args.target_file_mb)
    except (ValueError, OSError, OutputLocked) as exc:
        return _error(exc, 2)
    except StorageError as exc:
        return _error(exc, 1)
    print(f"cbrun: compacted {args.output_dir}: {result.num_parts_before} parts -> {result.num_parts_after}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from cbrun.jobs.model.convert_llama2c import convert_llama2c

    try:
        convert_llama2c(args.checkpoint, args.tokenizer, args.out_dir)
    except (ValueError, OSError) as exc:
        return _error(exc, 2)
    print(f"cbrun: wrote a Hugging Face model directory to {args.out_dir}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cbrun.jobs.cli.demo import run_demo

    print(
        "cbrun demo: building a tiny model with RANDOM weights; its completions are noise text, the point is "
        "the pipeline (reader -> engine -> writer)."
    )
    summary = run_demo(args.work_dir, output_dir=args.output, num_rows=args.num_rows, progress=not args.no_progress)
    print(summary.line())
    print(
        f"cbrun demo: output in {Path(summary.output_dir).resolve()} (part-*.parquet, _cbrun/stats.json); "
        f"read it with cbrun.jobs.output.output_dir.read_output(DIR)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
