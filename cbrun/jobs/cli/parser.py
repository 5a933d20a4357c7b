"""The ``cbrun`` argument parser: every command's flags (``build_parser``), ``RUN_FLAGS`` (the manifest key each
``run`` flag sets) and ``EXIT_CODES`` (the help's epilog). ``cbrun.jobs.cli`` dispatches the parsed command.

Options are matched whole (``allow_abbrev=False``): ``--n 2`` is the ``--n`` flag, never a prefix of another.
The input formats the help names come from their registry (``cbrun.jobs.input.formats``) when a help is shown
(``_HelpNamingFormats``), so that parsing a command line imports none of them.
Text flags (``--template``, ``--stop``) take TOML's escapes, as a manifest string does (``cbrun.jobs.cli.values.cli_text``).
"""

from __future__ import annotations

import argparse
import difflib

from cbrun import __version__

EXIT_CODES = (
    "exit codes: 0 the job finished, its error rows within output.max_error_fraction (or there was nothing to do); "
    "1 an unexpected failure (the rows finished before it are committed; rerun to resume); "
    "2 a setup problem, reported before any work (bad manifest; missing or unusable input, column, model, weights, "
    "tokenizer, device or output directory; output holding another job; output in use by another run); "
    "3 the job finished, but more than output.max_error_fraction of its output rows are error rows (or all are); "
    "130 interrupted by SIGINT, 143 by SIGTERM (the finished rows are committed; rerun to resume)."
)

#: Stand in the help texts for the input formats' titles and for each format with its file names, until
#: ``_HelpNamingFormats`` fills them in.
_FORMAT_TITLES = "<input format titles>"
_FORMAT_LISTING = "<input formats>"

#: CLI flag -> (manifest section, key).
RUN_FLAGS = {
    "model": ("model", "path"),
    "revision": ("model", "revision"),
    "input": ("input", "path"),
    "output": ("output", "path"),
    "prompt_column": ("input", "prompt_column"),
    "prompt_ids_column": ("input", "prompt_ids_column"),
    "id_column": ("input", "id_column"),
    "template": ("input", "template"),
    "limit": ("input", "limit"),
    "max_new_tokens": ("sampling", "max_new_tokens"),
    "n": ("sampling", "n"),
    "stop": ("sampling", "stop"),
    "num_threads": ("engine", "num_threads"),
    "tensor_parallel_size": ("engine", "tensor_parallel_size"),
    "data_parallel_size": ("cluster", "data_parallel_size"),
    "temperature": ("sampling", "temperature"),
    "top_p": ("sampling", "top_p"),
    "top_k": ("sampling", "top_k"),
    "seed": ("sampling", "seed"),
    "overwrite": ("output", "overwrite"),
    "input_format": ("input", "format"),
    "output_format": ("output", "format"),
    "keep_columns": ("output", "keep_columns"),
    "shard": ("input", "shard"),
    "executor": ("cluster", "executor"),
    "replicas": ("cluster", "num_replicas"),
    "ray_address": ("cluster", "address"),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``cbrun`` parser: one subparser per command, ``run``'s options in groups by what they set."""
    parser = argparse.ArgumentParser(
        prog="cbrun",
        description=f"Offline batch LLM inference: prompts in ({_FORMAT_TITLES}, OpenAI batch files), Parquet "
        "completions out, resumable.",
        allow_abbrev=False,
        epilog=EXIT_CODES,
        add_help=False,
    )
    parser.add_argument("-h", "--help", action=_HelpNamingFormats)
    parser.add_argument("--version", action="version", version=f"cbrun {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add_command in (
        _add_run_command,
        _add_export_command,
        _add_status_command,
        _add_report_command,
        _add_compact_command,
        _add_convert_command,
        _add_demo_command,
        _add_passthrough_commands,
    ):
        add_command(commands)
    parser.command_parsers = dict(commands.choices)  # for parse_command_line's errors
    return parser


def _add_run_command(commands: argparse._SubParsersAction) -> None:
    """``cbrun run``: the manifest, then its options by group (each flag's key: ``RUN_FLAGS``)."""
    run = commands.add_parser(
        "run",
        allow_abbrev=False,
        help="run (or resume) a job",
        epilog=EXIT_CODES,
        description=(
            "Run a job described by a TOML manifest and/or flags; flags override the manifest. Relative paths resolve "
            "against the current directory. Rerunning the same job resumes it."
        ),
        add_help=False,
    )
    run.add_argument("-h", "--help", action=_HelpNamingFormats)
    run.add_argument("manifest", nargs="?", help="TOML manifest ([model] [input] [sampling] [engine] [output])")
    for add_options in (
        _add_files_options,
        _add_column_options,
        _add_sampling_options,
        _add_scale_options,
        _add_run_options,
    ):
        add_options(run)
    _name_settings_in_type_errors(run)


#: A flag's value type -> how a message says it (as the manifest's type check does).
_TYPE_WORDS = {int: "an integer", float: "a number"}


def _name_settings_in_type_errors(run: argparse.ArgumentParser) -> None:
    """Each typed flag of ``RUN_FLAGS`` says the setting it sets when its value does not convert (argparse would
    say only ``invalid int value``): ``argument --temperature: sampling.temperature must be a number, got 'abc'``."""
    for action in run._actions:
        if action.dest in RUN_FLAGS and action.type in _TYPE_WORDS:
            action.type = _setting_type(action.type, ".".join(RUN_FLAGS[action.dest]))


def _setting_type(convert: type, setting: str):
    """``convert`` (int or float), raising ``argparse.ArgumentTypeError`` naming ``setting`` on a bad value."""

    def converted(text: str):
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{setting} must be {_TYPE_WORDS[convert]}, got {text!r}") from None

    converted.__name__ = convert.__name__  # argparse's own messages name the type by it
    return converted


class _HelpNamingFormats(argparse.Action):
    """``-h`` / ``--help`` that fills the input formats into the parser's texts (``_FORMAT_TITLES``,
    ``_FORMAT_LISTING``), then prints the help and exits. The formats come from their registry
    (``cbrun.jobs.input.formats``: every module of the package, so a new format module is named with no other
    change), whose modules import pyarrow: only a help that is shown reads it, never a command being parsed."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(
            option_strings, dest, default=argparse.SUPPRESS, nargs=0, help="show this help message and exit"
        )

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from cbrun.jobs.input.formats import help_listing, input_formats

        titles = ", ".join(fmt.title for fmt in input_formats())
        for item in [parser, *parser._actions]:  # NOTE: argparse keeps no public list of a parser's options
            for attribute in ("description", "help"):
                text = getattr(item, attribute, None)
                if isinstance(text, str):
                    text = text.replace(_FORMAT_TITLES, titles).replace(_FORMAT_LISTING, help_listing())
                    setattr(item, attribute, text)
        parser.print_help()
        parser.exit()


def _add_files_options(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("model and files")
    group.add_argument(
        "--model",
        help="Hugging Face model directory, or a Hub id (ORG/NAME) read from the Hugging Face cache "
        "(HF_HOME, HF_HUB_CACHE) or downloaded into it; HF_HUB_OFFLINE=1 never downloads",
    )
    group.add_argument(
        "--revision", help="a Hub model's branch, tag or commit (default: main); the job records the commit it runs"
    )
    group.add_argument(
        "--input",
        help="an input file, a directory of them (names starting with '.' or '_' ignored; any other file it cannot "
        f"read is refused), or a saved datasets directory. Files read: {_FORMAT_LISTING} (names in any letter case)",
    )
    group.add_argument(
        "--output",
        help="output directory (part files, _SUCCESS, and cbrun's own _cbrun/ folder); "
        "not the input, nor inside or around it",
    )
    group.add_argument(
        "--input-format",
        choices=("auto", "openai-batch"),
        help="openai-batch: OpenAI batch request lines (auto: recognised when no prompt setting is given)",
    )
    group.add_argument(
        "--output-format",
        choices=("parts", "openai-batch"),
        help="openai-batch: also write OUTPUT_DIR/_results.jsonl (OpenAI batch output) when the job finishes",
    )


def _add_column_options(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("input columns")
    group.add_argument("--prompt-column", help="text column holding the prompt")
    group.add_argument("--prompt-ids-column", help="list<int> column of prompt token ids (used as given)")
    group.add_argument("--id-column", help="column of row ids (default: the row index)")
    group.add_argument(
        "--template",
        help="prompt template with {column} fields, e.g. 'Q: {question}\\nA:' "
        "(\\n is a newline, as in a manifest; \\\\ for a backslash)",
    )
    group.add_argument("--limit", type=int, help="only the first N rows")
    group.add_argument(
        "--keep-column",
        dest="keep_columns",
        action="append",
        metavar="COLUMN",
        help="carry this input column into every output row (repeatable)",
    )


def _add_sampling_options(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("sampling")
    group.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        dest="max_new_tokens",
        type=int,
        help="most tokens to generate per sample (--max-tokens: vLLM's name)",
    )
    group.add_argument("--n", type=int, help="samples per row")
    group.add_argument("--stop", action="append", help="stop string (repeatable; \\n is a newline)")
    group.add_argument("--temperature", type=float, help="0 is greedy")
    group.add_argument(
        "--top-p",
        type=float,
        help="nucleus sampling: draw from the smallest set of tokens whose "
        "probability sums to at least this (1 is off)",
    )
    group.add_argument("--top-k", type=int, help="draw from the k most likely tokens only (0 or -1 is off)")
    group.add_argument("--seed", type=int, help="job seed; each row's seed derives from it and the row id")


def _add_scale_options(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("scale (threads, ranks, replicas, shards)")
    group.add_argument(
        "--num-threads",
        type=int,
        help="CPU threads (default: auto, 1 for a model under 10M parameters, else the physical cores)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="split each replica's model over this many ranks, one process and device each (default 1)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        help="run this many replicas on this node, each a shard of the job on its own devices (default 1)",
    )
    group.add_argument(
        "--shard",
        metavar="I/N",
        help="run shard I of N (0-based) of the job, e.g. $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT: "
        "a disjoint share of the rows; the N shards write into one output directory",
    )
    group.add_argument(
        "--executor",
        choices=("local", "ray"),
        help="local: one engine in this process (default); ray: a Ray Data pool of engine replicas "
        "(cluster.num_replicas, ...; needs the extra cbrun[ray])",
    )
    group.add_argument(
        "--replicas",
        type=int,
        help="engine replicas of --executor ray (cluster.num_replicas; each of --tensor-parallel-size ranks)",
    )
    group.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="the Ray cluster to join with --executor ray (auto: the one `ray start` runs here); "
        "absent: a local Ray instance",
    )


def _add_run_options(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("the run")
    group.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="discard the output directory's results when it holds a different job",
    )
    group.add_argument(
        "--retry-errors",
        action="store_true",
        help="take the rows with error rows out of the output and run them again (e.g. after a fix); "
        "each row is in the output once afterwards",
    )
    group.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set any manifest key, e.g. --set engine.max_batch_tokens=1024 (repeatable)",
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_export_command(commands: argparse._SubParsersAction) -> None:
    """``cbrun export``: an output as JSON Lines."""
    export = commands.add_parser(
        "export",
        allow_abbrev=False,
        help="write an output directory's rows as JSON Lines",
        description=(
            "Write the committed rows of an output directory as OpenAI batch output lines (one per input row, in "
            "input order) or as plain JSON rows; the parts are not changed."
        ),
    )
    export.add_argument("output_dir", help="a cbrun output directory")
    export.add_argument("--format", choices=("openai-batch", "jsonl"), default="openai-batch")
    export.add_argument(
        "--to",
        help="file to write (default: OUTPUT_DIR/_results.jsonl or OUTPUT_DIR/_output.jsonl; "
        "the _ keeps the folder a Parquet data set)",
    )


def _add_status_command(commands: argparse._SubParsersAction) -> None:
    """``cbrun status``: an output's progress, read only."""
    status_codes = (
        "exit codes (those cbrun run gives for the same output): 0 complete, its error rows within "
        "output.max_error_fraction; 1 not complete yet; 2 not a cbrun output; 3 complete, but more than "
        "output.max_error_fraction of its output rows are error rows (rerun them with cbrun run ... "
        "--retry-errors)"
    )
    status = commands.add_parser(
        "status",
        allow_abbrev=False,
        help="rows done per shard and in total, error rows; "
        "whether the job is complete (exit 0 complete, 1 not yet, 2 not a cbrun output, "
        "3 complete with too many error rows)",
        description="Rows done per shard and in total, error rows, and whether the job is "
        "complete; reads the output, locks and writes nothing.",
        epilog=status_codes,
    )
    status.add_argument("output_dir", help="the job's output directory")


def _add_report_command(commands: argparse._SubParsersAction) -> None:
    """``cbrun report``: an output's HTML page."""
    report = commands.add_parser(
        "report",
        allow_abbrev=False,
        help="an HTML page of a job's output: charts over "
        "time, distributions, errors, settings, cost (needs cbrun[report])",
        description="Write one self-contained HTML page (inline SVG charts, no JavaScript, "
        "readable offline) of an output directory's timelines, rows and "
        "settings, and PNG copies of its charts; reads the output, locks "
        "nothing, and works on a running job too.",
    )
    report.add_argument("output_dir", help="the job's output directory")
    report.add_argument(
        "--out",
        help="HTML file to write (default: OUTPUT_DIR/_cbrun/report.html); the PNGs go "
        "in a folder of the same name without .html",
    )
    report.add_argument(
        "--price-per-hour",
        type=float,
        metavar="USD",
        help="USD per GPU-hour: adds USD per million generated tokens and GPU-hours per billion",
    )


def _add_compact_command(commands: argparse._SubParsersAction) -> None:
    """``cbrun compact``: merge an output's small parts."""
    compact = commands.add_parser(
        "compact",
        allow_abbrev=False,
        help="merge an output's small parts into files of "
        "about --target-file-mb MB (kill-safe; the output still resumes)",
        description="Merge the committed parts of an output (a directory or an s3:// or "
        "gs:// URI) into files of about --target-file-mb MB each; takes the "
        "output's lock, so it refuses while a run writes it (exit 2).",
    )
    compact.add_argument("output_dir", help="the job's output (directory or URI)")
    compact.add_argument("--target-file-mb", type=float, default=256.0, help="size of the merged files (256)")


def _add_convert_command(commands: argparse._SubParsersAction) -> None:
    """``cbrun convert-llama2c``."""
    convert = commands.add_parser(
        "convert-llama2c", allow_abbrev=False, help="convert a llama2.c checkpoint to a Hugging Face directory"
    )
    convert.add_argument("checkpoint", help="llama2.c model .bin")
    convert.add_argument("tokenizer", help="llama2.c tokenizer .bin")
    convert.add_argument("out_dir", help="directory to write")


def _add_demo_command(commands: argparse._SubParsersAction) -> None:
    """``cbrun demo``: a small job on a tiny random model."""
    demo = commands.add_parser(
        "demo", allow_abbrev=False, help="run a small job on a tiny random-weight model (no download)"
    )
    demo.add_argument(
        "--work-dir", default="cbrun-demo", help="directory for the demo model and prompts (default: ./cbrun-demo)"
    )
    demo.add_argument("--output", help="the job's output directory (default: WORK_DIR/output)")
    demo.add_argument("--num-rows", type=int, default=64, help="prompts in the demo input (default: 64)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_passthrough_commands(commands: argparse._SubParsersAction) -> None:
    """``cbrun bench`` and ``cbrun lm-eval``: listed here, parsed by their own parsers."""
    commands.add_parser(
        "bench", add_help=False, help="throughput benchmark against transformers (cbrun bench --help for its options)"
    )
    commands.add_parser(
        "lm-eval",
        add_help=False,
        help="lm-evaluation-harness with --model cbrun registered "
        "(needs the eval extra; cbrun lm-eval --help for its options)",
    )


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """``build_parser``'s parse of ``argv``, where an unknown option is reported by its command's parser (its own
    usage line, and the nearest option name) rather than by the top-level one.

    Raises:
        SystemExit: with code 2 (argparse's), after printing the usage and the error to stderr.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = parser.command_parsers[args.command]
        # NOTE: argparse keeps no public list of a parser's options; _actions is what argcomplete reads too.
        options = [o for action in command._actions for o in action.option_strings]
        # The hint follows every argument as given, never between an option and its value.
        nearest = {
            flag: close[0]
            for flag in (arg.split("=", 1)[0] for arg in unknown if arg.startswith("-"))
            if (close := difflib.get_close_matches(flag, options, n=1, cutoff=0.6))
        }
        hint = ", ".join(close if len(nearest) == 1 else f"{close} for {flag}" for flag, close in nearest.items())
        command.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {hint}?)" if hint else ""))
    return args
