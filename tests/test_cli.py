"""The command line: one-line errors before any work, the store commands, and the listing of every config field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.cli.config_docs import ConfigField, config_fields
from pipeline.cli.main import UsageError, build_config, checked, main, parser
from schemas.config import RunConfig


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--task", "chess"], "unknown task 'chess'; valid: calculator"),
        (["--advantage", "ppo2"], "unknown advantage estimator 'ppo2'; valid: gae, grpo, reinforce++"),
        (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such file or directory"),
        (["--rollouts", "10", "--group-size", "4"], "rollouts (10) must be a multiple of group_size (4)"),
        (["--set", "ppo.learning_rate=-1"], "ppo.learning_rate: Input should be greater than 0"),
        (["--set", "ppo.nonsense=1"], "unknown config field 'ppo.nonsense'"),
        (
            ["--set", "generation.max_context_tokens=8192"],
            "max_context_tokens (8192) exceeds the longest context the model takes (4096 tokens)",
        ),
        (["--set", "generation.max_new_tokens=4096"], "max_new_tokens (4096) must be below max_context_tokens (4096)"),
        (
            ["--runner", "ray", "--set", "runner.ray_address=127.0.0.1:1"],
            "runner.ray_address '127.0.0.1:1': no Ray cluster answers there",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_choices_and_writes_nothing(tmp_path, capsys, flags, message):
    runs = tmp_path / "runs"
    assert main(["run", "--runs-dir", str(runs), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not runs.exists() or not any(p.name != ".prefect" for p in runs.iterdir())


def test_eval_takes_the_task_flags_of_the_run_that_trained_its_warm_start():
    """`mtrl eval` trains no warm start, yet task.tools may set up the warm start's task (sft.task):
    the run's own flags are accepted; a task that neither the run nor its warm start names is not."""
    tools = {"calculator": ["calculate"], "weather": ["get_weather", "calculate"]}
    task_flags = ["--task", "calculator", f"--set=task.tools={json.dumps(tools)}"]
    warm_started = ["eval", *task_flags, "--set=sft.task=weather"]
    assert checked(build_config(parser().parse_args(warm_started))).sft.task == "weather"
    with pytest.raises(UsageError, match=r"task.tools names \['weather'\], which the run does not use"):
        checked(build_config(parser().parse_args(["eval", *task_flags])))


def test_a_model_directory_without_a_tokenizer_is_refused(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert main(["run", "--runs-dir", str(tmp_path / "runs"), "--model", str(tmp_path / "model")]) == 2
    assert "no tokenizer files" in capsys.readouterr().err


@pytest.mark.usefixtures("prefect_server")
def test_run_then_ls_show_lineage(tmp_path, capsys):
    runs = str(tmp_path / "runs")
    flags = ["--iterations", "1", "--rollouts", "4", "--group-size", "2", "--max-turns", "2"]
    assert main(["run", "--runs-dir", runs, *flags, "--set", "generation.max_new_tokens=48"]) == 0
    out = capsys.readouterr().out
    assert "datasets.load_from_disk(" in out and "compute-advantages" in out
    assert main(["ls", "--runs-dir", runs]) == 0
    listing = capsys.readouterr().out
    advantages = next(line.split()[1] for line in listing.splitlines() if line.startswith("compute-advantages"))
    assert main(["show", f"compute-advantages/{advantages[:6]}", "--runs-dir", runs]) == 0
    shown = capsys.readouterr().out
    assert '"estimator": "grpo"' in shown and "verified" in shown
    assert main(["lineage", f"compute-advantages/{advantages}", "--runs-dir", runs]) == 0
    chain = capsys.readouterr().out.splitlines()
    assert chain[0].startswith("compute-advantages/") and chain[-1].startswith("policy/")
    assert sum(line.startswith("generate-rollouts/") for line in chain) >= 1
    assert main(["show", "compute-advantages/zzzz", "--runs-dir", runs]) == 2

    # mtrl diff: the same data is the same; one changed advantage is found and named
    import shutil

    import datasets

    copy = tmp_path / "copy"
    shutil.copytree(runs, copy)
    assert main(["diff", runs, str(copy)]) == 0
    assert capsys.readouterr().out.strip().endswith("0 different")
    folder = copy / "compute-advantages" / advantages
    rows = datasets.load_from_disk(str(folder))
    changed = rows.map(lambda row, i: {"advantages": [a + (i == 0) for a in row["advantages"]]}, with_indices=True)
    changed.save_to_disk(str(tmp_path / "changed"))
    shutil.rmtree(folder / "data", ignore_errors=True)
    for path in folder.glob("*.arrow"):
        path.unlink()
    for path in (tmp_path / "changed").iterdir():
        shutil.copy(path, folder / path.name)
    assert main(["diff", runs, str(copy)]) == 2
    report = capsys.readouterr()
    assert "DIFFERENT  ('compute-advantages', 0, None)" in report.out and "differ: ['advantages']" in report.out
    assert "1 stored item(s) differ" in report.err


def test_eval_rolls_out_a_policy_storing_only_the_imported_model(tmp_path, capsys):
    import json

    from pipeline.store.versions import Store

    runs = tmp_path / "runs"
    assert main(["eval", "--runs-dir", str(runs), "--rollouts", "4", "--group-size", "2", "--max-turns", "3"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["rollouts"] == 4 and 0.0 <= metrics["success_rate"] <= 1.0 and "per_task" in metrics
    # the starting model is imported as a run would import it; no rollout is stored
    (imported,) = Store(runs).versions()
    assert imported.stage == "policy" and imported.iteration == -1
    assert metrics["policy"] == str(Store(runs).policy_dir(imported.version))


def test_a_model_without_a_chat_template_is_refused(tmp_path, capsys):
    import shutil

    from pipeline.models.base_model import EMBEDDED_POLICY

    model = tmp_path / "model"
    shutil.copytree(EMBEDDED_POLICY, model, ignore=shutil.ignore_patterns("chat_template.jinja"))
    runs = tmp_path / "runs"
    assert main(["run", "--runs-dir", str(runs), "--model", str(model)]) == 2
    assert "has no chat template" in capsys.readouterr().err
    assert not runs.exists() or not any(p.name != ".prefect" for p in runs.iterdir())


def test_docs_config_md_is_what_mtrl_config_prints(capsys):
    assert main(["config", "--format", "markdown"]) == 0
    docs = Path(__file__).parents[1] / "docs" / "config.md"
    assert docs.read_text() == capsys.readouterr().out, (
        "docs/config.md is stale: regenerate it with `mtrl config --format markdown > docs/config.md`"
    )


def test_mtrl_config_lists_one_section(capsys):
    assert main(["config", "ppo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("  ppo.clip_ratio_c "))
    assert lines[row].split() == ["ppo.clip_ratio_c", "float", "|", "null", "3", "(1,", "inf)"]
    assert lines[row + 1].strip().startswith("Dual clip:")
    assert not any("task.rollouts" in line for line in lines)


def _set(assignment: str) -> RunConfig:
    return build_config(parser().parse_args(["run", "--set", assignment]))


def test_every_listed_field_takes_its_listed_default_through_set():
    fields = config_fields()
    assert len({f.name for f in fields}) == len(fields) > 50
    for field in fields:
        assert field.description, f"{field.name} has no description"
        assert _set(f"{field.name}={field.default}") == RunConfig(), field.name


def _out_of_range(field: ConfigField) -> list[str]:
    """A value just past each bound of the field, or one that is none of its choices."""
    if field.choices:
        return ["not-a-choice"]
    past = {"ge": lambda b: b - 1, "gt": lambda b: b, "le": lambda b: b + 1, "lt": lambda b: b}
    return [json.dumps(past[kind](bound)) for kind, bound in field.bounds.items()]


@pytest.mark.parametrize(
    ("name", "value"),
    [(f.name, value) for f in config_fields() for value in _out_of_range(f)],
)
def test_a_value_past_a_fields_range_is_refused_naming_the_field(name, value):
    with pytest.raises(UsageError, match=rf"^invalid config: {re.escape(name)}: Input should be"):
        _set(f"{name}={value}")
