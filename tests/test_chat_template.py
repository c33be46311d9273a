"""The chat template a run uses: one that hides the task's tools is refused before any work, and
model.chat_template replaces it (a template mtrl ships, or a file)."""

from __future__ import annotations

import shutil

import pytest

from pipeline.models.base_model import EMBEDDED_POLICY, SHIPPED_TEMPLATES, import_base_policy, starting_tokenizer
from pipeline.store.versions import Store
from stages.policy.loading import ModelError, load_tokenizer

# Plain ChatML without a tools section, as SmolLM2-135M-Instruct ships: tools are dropped silently.
CHATML_WITHOUT_TOOLS = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture
def model_without_tools(tmp_path):
    """The embedded policy with its chat template replaced by one that drops the tools."""
    folder = tmp_path / "chatml-model"
    shutil.copytree(EMBEDDED_POLICY, folder)
    (folder / "chat_template.jinja").write_text(CHATML_WITHOUT_TOOLS)
    assert load_tokenizer(folder).chat_template == CHATML_WITHOUT_TOOLS
    return folder


def test_a_template_that_drops_the_tools_is_refused(model_without_tools, small_config):
    config = small_config.with_overrides({"model.path": str(model_without_tools)})
    with pytest.raises(ValueError) as refused:
        starting_tokenizer(config)
    message = str(refused.value)
    assert str(model_without_tools) in message
    assert "renders the same" in message and "calculate" in message
    assert "model.chat_template" in message and "hermes" in message
    store = Store(config.store.runs_dir)
    with pytest.raises(ValueError, match="renders the same"):
        import_base_policy(store, config)
    assert store.versions() == []  # nothing was stored


def test_the_cli_refuses_it_with_one_line(model_without_tools, tmp_path, capsys):
    from pipeline.cli.main import main

    code = main(["eval", "--model", str(model_without_tools), "--runs-dir", str(tmp_path / "runs")])
    assert code == 2
    error = capsys.readouterr().err
    assert error.startswith("mtrl: error: ") and "model.chat_template" in error


def test_an_unknown_template_is_a_clear_error(small_config):
    config = small_config.with_overrides({"model.chat_template": "no-such-template"})
    with pytest.raises(ModelError, match="no such file.*hermes"):
        starting_tokenizer(config)


def test_the_override_is_stored_with_the_policy_and_trains(model_without_tools, small_config, tmp_path, prefect_server):
    from pipeline.orchestration.flows import rl_training

    config = small_config.with_overrides(
        {"model.path": str(model_without_tools), "model.chat_template": "hermes", "generation.max_new_tokens": 24}
    )
    store = Store(config.store.runs_dir)
    (result,) = rl_training(config)
    base = store.manifest("policy", result["policy"])
    assert base.extra("chat_template") == "hermes"
    stored = load_tokenizer(str(store.policy_dir(result["policy"])))
    assert stored.chat_template == SHIPPED_TEMPLATES["hermes"].read_text()
    # the rollouts' first context holds the tools, and a trained policy keeps the template
    first_tools = result["versions"]["execute-tools"][0]
    first_turn = store.load(
        "generate-rollouts", store.manifest("execute-tools", first_tools).parents["generate-rollouts"]
    )
    prompt = stored.decode(first_turn[0]["context_token_ids"])
    assert "# Tools" in prompt and '"name": "calculate"' in prompt
    trained = load_tokenizer(str(store.policy_dir(result["next_policy"])))
    assert trained.chat_template == stored.chat_template

    # the same template given as a file is the same policy; the model's own template another one
    template_file = tmp_path / "hermes-copy.jinja"
    template_file.write_text(SHIPPED_TEMPLATES["hermes"].read_text())
    with store.lock():
        assert (
            import_base_policy(store, config.with_overrides({"model.chat_template": str(template_file)}))
            == (result["policy"])
        )
        assert (
            import_base_policy(store, config.with_overrides({"model.path": None, "model.chat_template": None}))
            != (result["policy"])
        )
