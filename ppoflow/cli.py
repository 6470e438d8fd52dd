"""The `ppoflow` command: train, query, show, diagnose, report, config, schema, reward-model."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

EXAMPLES = """\
examples:
  ppoflow train                                          # the embedded default: tiny model, CPU, minutes
  ppoflow train trainer.total_training_steps=10 algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=8
  ppoflow train --config conf/my_run.yaml actor_rollout_ref.actor.optim.lr=1e-6
  ppoflow query runs/demo "SELECT iter, avg(score) FROM rewards GROUP BY iter ORDER BY iter"
  ppoflow config trainer.experiment_name=x               # print the effective config
  ppoflow schema rollouts                                # the documented columns of a table
  ppoflow show runs/demo --worst 3                       # responses, rewards and per-token values
  ppoflow explore runs/demo                              # the run's rollouts in the browser (loopback)
  ppoflow diagnose runs/demo                             # health checks; exit 1 on a warning
  ppoflow report runs/demo                               # PNG charts and report.md in runs/demo/report/
  ppoflow reward-model --out models/addition-rm          # train a reward model on labelled addition answers
  ppoflow export runs/demo out/                          # the final actor as Hugging Face directories
"""


DIAGNOSED_STEPS = 50
"""The newest steps `ppoflow diagnose` reads by default (--last): a step of a long run is diagnosed
in about the time it takes in a short one, by what the run does now."""


def _quiet_libraries(verbose: bool) -> None:
    """Prefect's per-task INFO lines and transformers' load bars drown the one line per iteration."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if verbose:  # Prefect's per-task lines, whatever level the environment asked for (unless DEBUG)
        if os.environ.get("PREFECT_LOGGING_LEVEL", "").upper() != "DEBUG":
            os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"
    else:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")  # converting a GGUF model draws a tqdm bar
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppoflow",
        description="RL for language models as a Prefect workflow of cached, queryable stages.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ppoflow {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = commands.add_parser("train", help="run PPO/GRPO training (Prefect flow 'ppo-train')")
    config = commands.add_parser("config", help="print the effective config (defaults + file + overrides)")
    for sub in (train, config):
        sub.add_argument("--config", help="YAML file of overrides (verl key names)")
        sub.add_argument("overrides", nargs="*", help="dotted key=value overrides, as in verl")
    train.add_argument("-v", "--verbose", action="store_true", help="show Prefect's and transformers' logs")
    query = commands.add_parser("query", help="run SQL over a run's tables (read-only DuckDB)")
    query.add_argument("run_dir", type=_user_path)
    query.add_argument("sql")
    query.add_argument("--format", choices=["table", "csv", "json"], default="table")
    show = commands.add_parser("show", help="responses of one iteration with rewards and per-token values")
    show.add_argument("run_dir", type=_user_path)
    show.add_argument("--iter", type=int, default=None, help="iteration (default: the last)")
    which = show.add_mutually_exclusive_group()
    which.add_argument("--best", type=_count, metavar="N", help="the N highest-scoring responses")
    which.add_argument("--worst", type=_count, metavar="N", help="the N lowest-scoring responses")
    which.add_argument("--random", type=_count, metavar="N", help="N responses at random (default 3)")
    show.add_argument("--seed", type=int, default=0, help="seed of --random")
    explore = commands.add_parser(
        "explore", help="browse a run's samples, tokens and metrics in the browser (a loopback web server)"
    )
    explore.add_argument("run_dir", type=_user_path)
    explore.add_argument(
        "--port", type=_port, default=0, help="port to serve on (default: one the system picks)"
    )
    explore.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    explore.add_argument(
        "--allow-remote",
        action="store_true",
        help="serve on a --host that is not loopback, and answer requests from beyond this machine",
    )
    diagnose = commands.add_parser(
        "diagnose",
        help="health checks over a run's metrics and rows: findings, causes, config keys to change",
    )
    diagnose.add_argument("run_dir", type=_user_path)
    diagnose.add_argument("--format", choices=["text", "json"], default="text")
    diagnose.add_argument(
        "--last",
        type=_at_least(0),
        default=DIAGNOSED_STEPS,
        metavar="N",
        help=f"read the newest N steps (default {DIAGNOSED_STEPS}; 0: every step of the run)",
    )
    report = commands.add_parser("report", help="PNG charts of a run's metrics and a markdown summary")
    report.add_argument("run_dir", type=_user_path)
    report.add_argument(
        "--out", type=_user_path, default=None, help="output folder (default: RUN_DIR/report)"
    )
    schema = commands.add_parser("schema", help="list the tables, or one table's documented columns")
    schema.add_argument("table", nargs="?")
    _reward_model_parser(commands)
    export = commands.add_parser(
        "export",
        help="an actor checkpoint as Hugging Face directories: OUT/model (merged), OUT/adapter (LoRA)",
    )
    export.add_argument(
        "source", type=_user_path, help="a run directory (its newest actor) or a checkpoint folder"
    )
    export.add_argument("out", type=_user_path, help="folder to write model/ (and adapter/) into")
    export.add_argument(
        "--unverified",
        action="store_true",
        help="export a run's checkpoint whose recorded digest (trainer_state.json) is gone, unchecked",
    )
    return parser


def _user_path(text: str) -> Path:
    """A path argument, `~` expanded as a shell would have (a quoted '~/x' reached ppoflow as is)."""
    return Path(os.path.expanduser(text))


def _at_least(minimum: int):
    """An argument type: a whole number of at least `minimum`."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not at least {minimum}")
        return value

    return whole_number


_count = _at_least(1)
"""An argument that counts something."""


def _reward_model_parser(commands) -> None:
    from ppoflow.reward_model_command import RewardModelRecipe

    default = RewardModelRecipe()
    rm = commands.add_parser(
        "reward-model",
        help="train a reward model (a sequence classifier with one label) from labelled responses",
        description="Train a reward model for reward_model.model.path: a base model's backbone with a new "
        "score head, fitted to responses labelled 1 (good) or 0 (bad), checked on held-out responses.",
    )
    rm.add_argument(
        "--out", type=_user_path, required=True, help="folder to write the model to (new or empty)"
    )
    rm.add_argument(
        "--data",
        default=default.data,
        help='JSONL of {"prompt", "response", "label": 0|1}, or builtin:addition (default)',
    )
    rm.add_argument("--base", default=default.base, help=f"causal LM to start from (default {default.base})")
    rm.add_argument("--steps", type=int, default=default.steps, help=f"optimizer steps ({default.steps})")
    rm.add_argument("--batch-size", type=int, default=default.batch_size, help="responses per step")
    rm.add_argument("--lr", type=float, default=default.lr, help=f"AdamW learning rate ({default.lr})")
    rm.add_argument("--seed", type=int, default=default.seed)
    rm.add_argument(
        "--examples", type=int, default=default.examples, help="training responses of builtin:addition"
    )
    rm.add_argument("--num-threads", type=_count, default=None, help="torch CPU threads (default: torch's)")


def _version() -> str:
    from ppoflow import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
        sys.stdout.flush()  # inside the try: a reader that left shows up at the last flush too
    except KeyboardInterrupt:  # before training started (`train` reports its own interrupts)
        print("\nppoflow: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader closed the pipe (`ppoflow diagnose --format json | head -1`). git and coreutils
        # die of SIGPIPE there, which the shell reports as 141 (128 + 13): `set -o pipefail` scripts
        # already expect it from `yes | head`, while 0, 1 or 2 would claim a diagnose verdict on output
        # that was cut off. stdout goes to devnull so the interpreter's flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    args.program = argv is None  # the `ppoflow` program (its own process), not a call from Python
    if (loop := _link_loop_argument(args)) is not None:
        print(f"ppoflow: {loop}", file=sys.stderr)
        return 2
    match args.command:
        case "train":
            return _train(args)
        case "config":
            return _config(args)
        case "query":
            return _query(args)
        case "schema":
            return _schema(args)
        case "show":
            return _show(args)
        case "explore":
            return _explore(args)
        case "diagnose":
            return _diagnose(args)
        case "report":
            return _report(args)
        case "reward-model":
            return _reward_model(args)
        case "export":
            return _export(args)
        case _:
            _parser().print_help()
            return 0


def _link_loop_argument(args) -> str | None:
    """A path argument that is a symbolic link loop (`ln -s loop loop`) names nothing: said in one
    line here, where each command's own resolving raised a traceback or called it missing."""
    for name, what in (
        ("run_dir", "run directory"),
        ("source", "export source"),
        ("out", "output folder"),
        ("base", "base model (--base)"),
        ("data", "labelled data (--data)"),
    ):
        value = getattr(args, name, None)
        if value is None or os.path.exists(value):  # exists() is False for a loop
            continue
        from ppoflow.conf.path_checks import is_link_loop

        if is_link_loop(value):
            return (
                f"{what} '{value}' is a symbolic link loop: a link on the way leads back to itself, so "
                "the path names nothing"
            )
    return None


def _load(args):
    from ppoflow.conf import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return None


def _train(args) -> int:
    _quiet_libraries(args.verbose)
    if not args.verbose:  # before the config is loaded: checking a GGUF model converts it once
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    cfg = _load(args)
    if cfg is None:
        return 2
    from ppoflow.train_command import train_configured

    return train_configured(cfg, args.verbose, program=args.program)


def _config(args) -> int:
    cfg = _load(args)
    if cfg is None:
        return 2
    print(cfg.to_yaml(origins=True), end="")
    for warning in cfg.warnings():
        print(f"ppoflow: {warning}", file=sys.stderr)
    return 0


def _query(args) -> int:
    from ppoflow.query_output import print_rows
    from ppoflow.tasks.storage.catalog import stray_step_folders
    from ppoflow.tasks.storage.confined_query import query_batches

    try:
        with query_batches(args.run_dir, args.sql) as (columns, batches):
            print_rows(columns, batches, args.format, _console(200, highlight=True))
    except (ValueError, FileNotFoundError) as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
    if strays := stray_step_folders(args.run_dir):
        names = ", ".join(f"'{name}'" for name in strays[:3]) + (", …" if len(strays) > 3 else "")
        print(f"ppoflow: note: not read, not a step's folder (iter=NNNNNN): {names}", file=sys.stderr)
    return 0


def _console(width: int, *, highlight: bool = False):
    """A rich Console, `width` columns wide when not on a terminal, that leaves a closed pipe to main:
    rich's own handler exits with status 1, which for diagnose would read as "a warning found"."""
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else width, highlight=highlight)
    console.on_broken_pipe = _reraise_broken_pipe  # type: ignore[method-assign]
    return console


def _reraise_broken_pipe() -> None:
    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def _show(args) -> int:
    from ppoflow.show import load_rows, pick, render, run_tokenizer

    mode, count = next(
        ((m, getattr(args, m)) for m in ("best", "worst", "random") if getattr(args, m)), ("random", 3)
    )
    try:
        iteration, rows = load_rows(args.run_dir, args.iter)
    except (ValueError, FileNotFoundError) as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
    console = _console(160)
    render(console, iteration, pick(rows, mode, count, args.seed), run_tokenizer(args.run_dir))
    return 0


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0–65535)")
    return value


def _explore(args) -> int:
    from ppoflow.explorer.command import explore

    return explore(args.run_dir, host=args.host, port=args.port, allow_remote=args.allow_remote)


SEVERITY_STYLE = {"CRITICAL": "bold red", "WARNING": "yellow", "INFO": "cyan"}


def _diagnose(args) -> int:
    """Exit 0 when nothing is a warning or worse, 1 when something is, 2 for bad input."""
    import json

    from rich.text import Text

    from ppoflow.tasks.observe.diagnose import RunDirError, diagnose, exit_code, load_run, render_text

    try:
        run = load_run(args.run_dir, last=args.last or None)
    except RunDirError as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
    findings = diagnose(run)
    code = exit_code(findings)
    if args.format == "json":
        out = {"run_dir": str(args.run_dir), "iterations": run.trained_iterations(), "exit_code": code}
        if run.window is not None:
            out["steps_in_run"] = run.window[1]
        print(json.dumps(out | {"findings": [f.to_dict() for f in findings]}, indent=1, default=str))
        return code
    console = _console(200)
    for line in render_text(args.run_dir, run, findings):
        word = line.split(" ", 1)[0]
        console.print(Text(line, style=SEVERITY_STYLE.get(word, "")), soft_wrap=True)
    return code


def _report(args) -> int:
    from ppoflow.tasks.observe.diagnose import RunDirError
    from ppoflow.tasks.observe.report import write_report

    try:
        written = write_report(args.run_dir, args.out)
    except (RunDirError, OSError) as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _export(args) -> int:
    _quiet_libraries(verbose=False)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # models load on the CPU; DeepSpeed would warn
    from ppoflow.engine.models import ModelLoadError
    from ppoflow.tasks.storage.export import ExportError, export_actor

    try:
        written = export_actor(args.source, args.out, unverified=args.unverified)
    except (ExportError, ModelLoadError, OSError) as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
    for form, path in written.items():
        print(f"{form:<9}{path}")
    return 0


def _schema(args) -> int:
    from ppoflow.tasks.storage.catalog import UPDATES_DOC
    from ppoflow.tasks.storage.schemas import TABLE_DOCS, describe

    if args.table is None:
        for name, doc in (TABLE_DOCS | {"updates": UPDATES_DOC}).items():
            print(f"{name:<14} {doc}")
        return 0
    if args.table == "updates":
        print(f"### updates\n\n{UPDATES_DOC}")
        return 0
    try:
        print(describe(args.table))
    except (KeyError, ValueError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error  # no quotes
        print(f"ppoflow: {message}", file=sys.stderr)
        return 2
    return 0


def _reward_model(args) -> int:
    _quiet_libraries(verbose=False)
    from ppoflow.engine.models import ModelLoadError
    from ppoflow.reward_model_command import RewardModelRecipe, report_lines, train_reward_model_dir

    recipe = RewardModelRecipe(
        data=args.data,
        base=args.base,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        examples=args.examples,
    )
    import torch

    if not torch.cuda.is_available():  # saving imports DeepSpeed, which would say it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        report = train_reward_model_dir(args.out, recipe)
    except (ValueError, OSError, ModelLoadError) as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
    for line in report_lines(args.out, recipe, report):
        print(line)
    return 0
