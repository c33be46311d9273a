"""`mtrl`: train, and read the versioned store.

mtrl run [flags]                 RL iterations (defaults: the CPU demo on the embedded model)
mtrl sft --sft-steps N [flags]   the warm start alone: fine-tune the starting model on demonstrations
mtrl ls [--runs-dir DIR]         every stored version
mtrl show STAGE/VERSION          a version's manifest and where its data is
mtrl lineage STAGE/VERSION       its chain of parents back to the starting policy
mtrl config [SECTION]            every config field: its --set name, type, default, range and meaning
mtrl view [RUNS_DIR]             an iteration's rollouts in the browser (or --out FILE.html)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import ValidationError

from pipeline.cli.config_docs import config_fields, config_markdown, config_table
from runtime import interpreter
from runtime.interrupt import remember_interrupts
from runtime.phases import PHASES
from runtime.threads import use_threads
from schemas.config import RunConfig, deep_merge
from schemas.manifest import MissingVersionError, StoreError

if TYPE_CHECKING:
    from pipeline.store.versions import Store

PHASES.mark("cli_imported")

# Every command has two parts: the handler parses its config, imports what it needs and checks
# its inputs, then returns its work, which main() runs. The handlers import torch, transformers,
# datasets and Prefect themselves (`mtrl ls` needs none of them), and main() runs them as one
# block of imports (runtime/interpreter.py: untracked_imports). `mtrl run` starts the Prefect
# API before its imports, so that the server's start overlaps them (pipeline/prefect_plumbing/servers.py).
Work = Callable[[], None]

RUN_FLAGS = {  # flag -> (config field, type, help)
    "--iterations": ("iterations", int, "RL iterations"),
    "--task": ("task.name", str, "environment"),
    "--rollouts": ("task.rollouts", int, "rollouts per iteration"),
    "--group-size": ("task.group_size", int, "samples per task"),
    "--max-turns": ("task.max_turns", int, "assistant turns per rollout at most"),
    "--advantage": ("advantage.estimator", str, "advantage estimator"),
    "--engine": ("generation.engine", str, "generation engine: hf or vllm"),
    "--seed": ("seed", int, "seed of tasks, sampling and training"),
    "--model": ("model.path", str, "local HF causal-LM directory, GGUF file or hub id (default: embedded tiny model)"),
    "--runner": ("runner.kind", str, "where tools run: thread or ray"),
    "--agent": ("agent.function", str, "MODULE:FUNCTION of an agent program run against mtrl's endpoint"),
    "--runs-dir": ("store.runs_dir", str, "root of the versioned store"),
    "--sft-steps": ("sft.steps", int, "warm-start steps on demonstrations before RL (0 = none)"),
}
EVAL_ITERATION = 10**6  # `mtrl eval` samples its tasks as this iteration: never one that trains


class UsageError(Exception):
    """A bad command line or config: printed as one line, exit status 2."""


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_config(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """Defaults (or `base`) < --config FILE < named flags < --set key=value; validated before any work."""
    try:
        config = base or RunConfig()
        if args.config:
            from_file = RunConfig.from_yaml(args.config).model_dump(mode="json", exclude_unset=True)
            config = RunConfig.model_validate(deep_merge(config.model_dump(mode="json"), from_file))
        overrides: dict[str, Any] = {}
        for flag, (field, _, _) in RUN_FLAGS.items():
            value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
            if value is not None:
                overrides[field] = value
        for assignment in args.set or []:
            key, sep, value = assignment.partition("=")
            if not sep:
                raise UsageError(f"--set {assignment}: expected KEY=VALUE, e.g. ppo.learning_rate=5e-5")
            overrides[key] = _parse_value(value)
        config = config.with_overrides(overrides)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise UsageError(f"invalid config: {problems}") from None
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    # Every command that does work builds its config here, before it starts any process (the
    # Prefect server included): they all inherit the thread count.
    use_threads(config.runner.threads, overlapping=config.stages_overlap())
    return config


def checked(config: RunConfig) -> RunConfig:
    """The config, after the pre-flight checks (pipeline/orchestration/preflight.py); a failure is a usage error."""
    from pipeline.orchestration.preflight import ConfigError, check_config

    try:
        check_config(config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return config


def start_flows(config: RunConfig) -> Callable[..., Any]:
    """What a command that runs flows does first: start the Prefect API in the background and
    check the config while it starts (a bad config stops it again at exit). Returns
    run_flow(flow, *args), which waits for the API and runs the flow on it."""
    from pipeline.prefect_plumbing import servers as prefect_servers

    api_ready = prefect_servers.start_api(config.store.runs_dir, config.runner.kind)
    checked(config)

    def run_flow(flow: Callable[..., Any], *args: Any) -> Any:
        from pipeline.prefect_plumbing import settings as prefect_settings

        own_api = api_ready()
        PHASES.mark("api_ready")
        with prefect_settings.flow_heartbeats(enabled=not own_api):  # no one reads them on our own server
            return flow(*args)

    return run_flow


# ---------------------------------------------------------------------------------------
# Commands: each returns its work (see Work above)
# ---------------------------------------------------------------------------------------


def command_run(args: argparse.Namespace) -> Work:
    config = build_config(args)
    run_flow = start_flows(config)
    from pipeline.monitoring import progress
    from pipeline.monitoring.report import write_report
    from pipeline.orchestration.flows import rl_training
    from pipeline.store.versions import Store
    from runtime.ray import RayError

    PHASES.mark("checks_done")

    def run() -> None:
        store = Store(config.store.runs_dir)
        log_stem = f"run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"  # the run's .log (Prefect's lines), .json
        try:
            with progress.shown(config.iterations, store.root / "logs" / f"{log_stem}.log", sys.stderr, args.verbose):
                results = run_flow(rl_training, config)
        except RayError as exc:
            raise UsageError(str(exc)) from None
        wall = time.time() - PHASES.marks["api_ready"]  # the flows' time, the API's start left out
        PHASES.mark("flows_done")
        curve, png = write_report(store, policy_version=results[-1]["next_policy"])
        PHASES.mark("report_done")
        log = write_run_log(store, results, log_stem)
        print(f"\n{curve}\n\nlearning curve: {png}")
        last = results[-1]
        print(f"\n{len(results)} iteration(s) in {wall:.1f} s (timings: {log}). Datasets of the last iteration:")
        for stage, versions in last["versions"].items():
            if isinstance(versions, list):  # one version per turn
                print(f"  {stage:<19} {len(versions)} turn(s), last: {store.path(stage, versions[-1])}")
            else:
                print(f"  {stage:<19} {store.path(stage, versions)}")
        print(f"  {'policy':<19} {store.policy_dir(last['next_policy'])}")
        print("Load any of them with:  import datasets; datasets.load_from_disk('<path above>')")

    return run


def command_sft(args: argparse.Namespace) -> Work:
    """The warm start alone: the same flow step `mtrl run` takes first with sft.steps > 0."""
    config = build_config(args)
    if config.sft.steps == 0:
        raise UsageError("mtrl sft trains for sft.steps steps, which is 0: give --sft-steps N (or --set sft.steps=N)")
    run_flow = start_flows(config)
    from pipeline.orchestration.flows import warm_start
    from pipeline.orchestration.stage_table import POLICY
    from pipeline.store.versions import Store

    def run() -> None:
        policy = run_flow(warm_start, config)
        store = Store(config.store.runs_dir)
        trained = store.manifest("sft", store.manifest(POLICY, policy).parents["sft"])
        first, last = trained.metrics["first_loss"], trained.metrics["last_loss"]
        demonstrations = config.sft.task or config.task.name
        print(f"sft/{trained.version}: {config.sft.steps} steps on {demonstrations} demonstrations")
        print(f"  loss per assistant token {first:.4f} -> {last:.4f}")
        print(f"policy/{policy}\n  {store.policy_dir(policy)}")
        # the same flags: RL finds this warm start in the store and starts from it
        print(f"RL from it (the warm start is reused, not trained again):\n  mtrl run {shlex.join(args.argv[1:])}")

    return run


def write_run_log(store: Store, results: list[dict[str, Any]], stem: str) -> Path:
    """RUNS_DIR/logs/STEM.json (STEM: run-<time>-<pid>, beside the run's .log of Prefect's lines): the
    command, the versions it made and where its time went (runtime/phases.py; the stages' own time is
    each manifest's wall_s). bench/orchestration.py reads it."""
    from runtime.files import replace_file

    folder = store.root / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.json"
    record = {"argv": sys.argv, "iterations": results, "phases": PHASES.as_dict()}
    replace_file(path, (json.dumps(record, indent=2, default=str) + "\n").encode())
    return path


def command_stage(args: argparse.Namespace) -> Work:
    """Re-run one stage: the config recorded in the input's lineage, then --config, flags, --set."""
    from pipeline.store.lineage import run_config
    from pipeline.store.versions import Store

    store = Store(args.runs_dir)
    source_stage, source_version = store.resolve(args.source)
    recorded = RunConfig.model_validate(
        deep_merge(run_config(store, source_stage, source_version), {"store": {"runs_dir": str(args.runs_dir)}})
    )
    config = build_config(args, base=recorded)
    run_flow = start_flows(config)
    from pipeline.orchestration.flows import rerun_stage

    def run() -> None:
        try:
            version = run_flow(rerun_stage, config, args.name, f"{source_stage}/{source_version}", args.policy)
        except ValueError as exc:  # RayError included
            raise UsageError(str(exc)) from None
        path = store.path(args.name, version)
        print(f"{args.name}/{version}\n  {path}\nLoad it with:  datasets.load_from_disk('{path}')")

    return run


def command_serve(args: argparse.Namespace) -> Work:
    """Serve rl-iteration as deployment rl-iteration/local: each run trains the next iteration."""
    config = checked(build_config(args))
    from pipeline.prefect_plumbing import settings as prefect_settings

    prefect_settings.configure(config.store.runs_dir)
    from pipeline.orchestration.flows import rl_iteration

    schedule = {"interval": args.interval} if args.interval else {"cron": args.cron} if args.cron else {}

    def run() -> None:
        print(f"serving rl-iteration/local on {config.store.runs_dir} ({schedule or 'no schedule: trigger runs'})")
        rl_iteration.serve(name="local", parameters={"config": config.model_dump(mode="json")}, limit=1, **schedule)

    return run


def command_eval(args: argparse.Namespace) -> Work:
    """Roll out a policy on fixed evaluation tasks and print its metrics; only the starting model is stored
    (imported, as a run would), never the rollouts."""
    config = checked(build_config(args))
    from pipeline.models.base_model import import_base_policy
    from pipeline.orchestration.episodes import run_episodes
    from pipeline.store.versions import Store
    from stages.assign_rewards import rollout_metrics
    from stages.generate_rollouts.engine import EngineSettings, open_engine
    from stages.policy.loading import load_tokenizer
    from stages.registry import Tasks

    def run() -> None:
        store = Store(config.store.runs_dir)
        try:  # the starting model is evaluated as a run would train it: imported (GGUF, chat template)
            if args.policy:
                version = store.resolve(f"policy/{args.policy}")[1]
            else:
                with store.lock():
                    version = import_base_policy(store, config)
        except ValueError as exc:  # ModelError too: a template that hides the tools
            raise UsageError(str(exc)) from None
        model_dir = store.policy_dir(version)
        tokenizer = load_tokenizer(str(model_dir))
        engine = open_engine(model_dir, tokenizer, EngineSettings.resolve(config))
        try:  # evaluation tasks come from their own seed, never the training iterations'
            turns = run_episodes(engine, tokenizer, config, iteration=EVAL_ITERATION)
        finally:
            engine.close()
        tasks = Tasks.resolve(config)
        metrics = rollout_metrics(turns, tasks.environments(), tasks.max_turns)
        print(json.dumps({"policy": str(model_dir), **metrics}, indent=2))

    return run


def command_report(args: argparse.Namespace) -> Work:
    from pipeline.monitoring.report import write_report
    from pipeline.store.versions import Store

    def run() -> None:
        curve, png = write_report(Store(args.runs_dir), args.out, args.policy)
        print(f"{curve}\n\nlearning curve: {png}")

    return run


def command_view(args: argparse.Namespace) -> Work:
    from pipeline.monitoring.viewer import serve, write_page
    from pipeline.store.versions import Store

    def run() -> None:
        store = Store(args.runs_dir)
        if args.out:
            print(f"{write_page(store, args.iteration, args.out)}  (open it in a browser)")
        else:
            serve(store, args.port, args.iteration)

    return run


def command_ls(args: argparse.Namespace) -> Work:
    from pipeline.store.versions import Store

    def run() -> None:
        store = Store(args.runs_dir)
        manifests = store.versions()
        if not manifests:
            print(f"no versions in {store.root}")
            return
        print(f"{'stage':<19} {'version':<17} {'iter':>4} {'turn':>4} {'rows':>6}  created")
        for m in manifests:
            iteration, turn, rows = ("" if value is None else value for value in (m.iteration, m.turn, m.rows))
            print(f"{m.stage:<19} {m.version:<17} {iteration:>4} {turn:>4} {rows:>6}  {m.created_at[:19]}")

    return run


def command_show(args: argparse.Namespace) -> Work:
    from pipeline.store.versions import Store

    def run() -> None:
        store = Store(args.runs_dir)
        stage, version = store.resolve(args.reference)
        manifest = store.manifest(stage, version)
        shown = manifest.model_dump(mode="json", exclude={"files", "source_files"}, exclude_none=True)
        print(json.dumps(shown, indent=2, sort_keys=True))
        problems = store.verify(stage, version)
        pruned = f" ({', '.join(manifest.pruned)} pruned by retention)" if manifest.pruned else ""
        print(f"\nfiles: {len(manifest.files)}{pruned}, " + ("verified" if not problems else "; ".join(problems)))
        print(f"path: {store.path(stage, version)}")
        if stage != "policy":
            print(f"load: datasets.load_from_disk('{store.path(stage, version)}')")

    return run


def command_audit(args: argparse.Namespace) -> Work:
    from pipeline.orchestration.stage_table import STAGES
    from pipeline.store.audit import audit_stored
    from pipeline.store.lineage import run_config
    from pipeline.store.versions import Store
    from stages.registry import load_plugins

    store = Store(args.runs_dir)
    stage, version = store.resolve(args.reference)
    turn_stages = [name for name, table in STAGES.items() if "completion_token_ids" in table.features]
    if stage not in turn_stages:
        raise UsageError(f"audit checks a dataset of turns: {', '.join(turn_stages)}")

    def run() -> None:
        problems = store.verify(stage, version)
        if problems:
            raise UsageError(f"{stage}/{version} files do not match the manifest: {'; '.join(problems)}")
        recorded = RunConfig.model_validate(run_config(store, stage, version))
        load_plugins(recorded.task.plugins)  # the prompts of a plugin's tasks are checked too
        settings = {"audit.rescore_fraction": args.rescore_fraction, "audit.tolerance": args.tolerance}
        report = audit_stored(store, stage, version, recorded.with_overrides(settings))
        print(json.dumps(report.as_dict(), indent=2))
        if not report.ok:
            raise UsageError(f"{stage}/{version} fails the audit: {report.problems[0]}")

    return run


def command_lineage(args: argparse.Namespace) -> Work:
    from pipeline.store.versions import Store

    def run() -> None:
        store = Store(args.runs_dir)
        stage, version = store.resolve(args.reference)
        for manifest in store.lineage(stage, version):
            where = ", ".join(
                f"{k}={getattr(manifest, k)}" for k in ("iteration", "turn") if getattr(manifest, k) is not None
            )
            print(f"{manifest.stage}/{manifest.version}  {where}")

    return run


def command_config(args: argparse.Namespace) -> Work:
    def run() -> None:
        fields = [f for f in config_fields() if args.section in (None, f.section)]
        if args.format == "markdown":
            print(config_markdown(fields))
        else:
            print(config_table(fields, width=min(shutil.get_terminal_size().columns, 100)))

    return run


def command_diff(args: argparse.Namespace) -> Work:
    from pipeline.store.diff import compare_runs

    def run() -> None:
        lines, different = compare_runs(args.left, args.right)
        print("\n".join(lines))
        if different:
            raise UsageError(f"{different} stored item(s) differ between {args.left} and {args.right}")

    return run


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


class RerunnableStages:
    """The choices of `mtrl stage NAME`, read from the stage table (which imports torch) only
    when argparse checks a name or prints them."""

    def names(self) -> list[str]:
        from pipeline.orchestration.stage_table import rerun_map

        return list(rerun_map())

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="mtrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = root.add_subparsers(dest="command", required=True)

    def config_flags(sub: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        sub.add_argument("--config", type=Path, help="YAML file with config sections")
        for flag, (field, kind, text) in RUN_FLAGS.items():
            if flag not in skip:
                sub.add_argument(flag, type=kind, help=f"{text} (config: {field})")
        sub.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config field, e.g. ppo.epochs=2")

    run = commands.add_parser("run", help="train: RL iterations through the Prefect flow")
    config_flags(run)
    run.add_argument(
        "--verbose", action="store_true", help="Prefect's flow- and task-run log lines on the console too, no live line"
    )
    run.set_defaults(handler=command_run)

    warm = commands.add_parser(
        "sft", help="warm start: fine-tune the starting model on demonstrations, stored as a policy"
    )
    config_flags(warm)
    warm.set_defaults(handler=command_sft)

    stage = commands.add_parser("stage", help="re-run one stage on a stored input, e.g. another estimator")
    # a metavar: argparse lists the choices (importing the stage table, and torch) only for --help
    stage.add_argument("name", choices=RerunnableStages(), metavar="NAME", help="the stage to re-run: %(choices)s")
    stage.add_argument("--from", dest="source", required=True, metavar="STAGE/VERSION", help="the stored input")
    stage.add_argument("--runs-dir", type=Path, default=Path("runs"))
    stage.add_argument(
        "--policy",
        help="ppo-update: the policy to train (default: the one that generated the rollouts; a run with "
        "ppo.max_staleness > 0 trained a newer one: its manifest's parents name it)",
    )
    config_flags(stage, skip=("--runs-dir", "--sft-steps"))  # the starting policy is in the lineage
    stage.set_defaults(handler=command_stage)

    evaluate = commands.add_parser(
        "eval", help="roll out a policy on fixed evaluation tasks; the rollouts are not stored"
    )
    config_flags(evaluate, skip=("--sft-steps",))  # a warm start is evaluated by its version: --policy
    evaluate.add_argument("--policy", help="a policy version of the runs dir (default: --model or the embedded one)")
    evaluate.set_defaults(handler=command_eval)

    serve = commands.add_parser("serve", help="serve rl-iteration as the deployment rl-iteration/local")
    config_flags(serve)
    timing = serve.add_mutually_exclusive_group()
    timing.add_argument("--interval", type=float, help="run an iteration every N seconds")
    timing.add_argument("--cron", help="run iterations on a cron schedule, e.g. '0 * * * *'")
    serve.set_defaults(handler=command_serve)

    for name, handler, text in (
        ("show", command_show, "a version's manifest"),
        ("lineage", command_lineage, "a version's parents back to the starting policy"),
        ("audit", command_audit, "check a dataset: token streams, lengths, logprobs, advantages, re-scoring"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("reference", metavar="STAGE/VERSION")
        sub.add_argument("--runs-dir", type=Path, default=Path("runs"))
        if name == "audit":
            sub.add_argument("--rescore-fraction", type=float, default=0.1, help="share of rollouts re-scored")
            sub.add_argument(
                "--tolerance", type=float, help="max |stored - re-scored| logprob (default: by the generating dtype)"
            )
        sub.set_defaults(handler=handler)
    report = commands.add_parser("report", help="learning curve of a run: table + PNG")
    report.add_argument("runs_dir", nargs="?", type=Path, default=Path("runs"), metavar="RUNS_DIR")
    report.add_argument("--out", type=Path, help="where to write the plot (default: RUNS_DIR/report)")
    report.add_argument("--policy", help="report the lineage of this policy version (default: the newest)")
    report.set_defaults(handler=command_report)
    diff = commands.add_parser("diff", help="do two runs dirs hold the same data (version names aside)?")
    diff.add_argument("left", type=Path, metavar="RUNS_DIR_A")
    diff.add_argument("right", type=Path, metavar="RUNS_DIR_B")
    diff.set_defaults(handler=command_diff)
    view = commands.add_parser("view", help="an iteration's rollouts in the browser: turns, tokens, advantages")
    view.add_argument("runs_dir", nargs="?", type=Path, default=Path("runs"), metavar="RUNS_DIR")
    view.add_argument("--iteration", type=int, help="the iteration shown first (default: the last)")
    view.add_argument("--out", type=Path, help="write one static HTML file of the iteration instead of serving")
    view.add_argument("--port", type=int, default=8765, help="serve on 127.0.0.1:PORT (0: any free port)")
    view.set_defaults(handler=command_view)
    ls = commands.add_parser("ls", help="every stored version")
    ls.add_argument("--runs-dir", type=Path, default=Path("runs"))
    ls.set_defaults(handler=command_ls)
    config = commands.add_parser("config", help="every config field: its --set name, type, default, range, meaning")
    sections = list(dict.fromkeys(field.section for field in config_fields()))
    config.add_argument("section", nargs="?", choices=sections, help="show this section only")
    config.add_argument("--format", choices=["table", "markdown"], default="table", help="markdown: docs/config.md")
    config.set_defaults(handler=command_config)
    return root


def error_message(exc: Exception) -> str:
    """One line for the user; a missing trained policy says how to rebuild it."""
    if isinstance(exc, MissingVersionError):
        from pipeline.store.lineage import rebuild_hint
        from pipeline.store.versions import Store

        return f"{exc}{rebuild_hint(Store(exc.root), exc.stage, exc.version)}"
    return str(exc)


def main(argv: list[str] | None = None, as_command: bool = False) -> int:
    """Run one command. `as_command`: this process is the `mtrl` command (entry), so its imports
    run untracked by the cycle collector; a test calling main() keeps its collector as it is."""
    args = parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # `mtrl sft` prints the `mtrl run` that continues it
    try:
        with interpreter.untracked_imports(enabled=as_command):
            work = args.handler(args)
        work()
    except (UsageError, StoreError) as exc:
        print(f"mtrl: error: {error_message(exc)}", file=sys.stderr)
        return 2
    return 0


def entry() -> NoReturn:
    """The `mtrl` command: main(), then an exit without the interpreter's teardown."""
    remember_interrupts()  # a Ctrl-C that Prefect would swallow still stops the run
    interpreter.exit_without_teardown(main(as_command=True))
