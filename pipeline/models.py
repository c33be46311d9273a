"""Where the starting policy comes from: the embedded tiny model, a local HF causal-LM directory,
or a hub id (loading it is stages/policy.py's); and the chat template it is imported with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schemas.config import RunConfig
from stages.policy import ModelError, load_tokenizer
from stages.tasks import check_tools_reach_the_model

EMBEDDED_POLICY = Path(__file__).resolve().parent / "embedded" / "policy"
# Templates mtrl ships, by the name model.chat_template gives them.
SHIPPED_TEMPLATES = {"hermes": Path(__file__).resolve().parent / "chat_templates" / "hermes.jinja"}


def resolve_model_dir(path: str | None) -> Path:
    """A local directory holding config, weights, tokenizer and chat template."""
    if not path:
        return EMBEDDED_POLICY
    local = Path(path).expanduser()
    if not local.exists():
        if local.is_absolute() or path.startswith(".") or path.count("/") != 1:
            raise ModelError(f"--model {path}: no such directory (and not a hub id of the form org/name)")
        try:  # a hub id, where the machine can reach a hub
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(path))
        except Exception as exc:
            raise ModelError(f"--model {path}: not a local directory and the hub download failed: {exc}") from None
    if not (local / "config.json").is_file():
        raise ModelError(f"--model {local}: no config.json; expected a save_pretrained causal-LM directory")
    if not any((local / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelError(f"--model {local}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return local.resolve()


def chat_template_override(setting: str | None) -> str | None:
    """The text of model.chat_template (a template mtrl ships, by name, or a Jinja file), or None
    to keep the model's own."""
    if setting is None:
        return None
    path = SHIPPED_TEMPLATES.get(setting) or Path(setting).expanduser()
    if not path.is_file():
        raise ModelError(
            f"model.chat_template {setting}: no such file (a Jinja chat template, or one mtrl ships: "
            f"{', '.join(SHIPPED_TEMPLATES)})"
        )
    return path.read_text()


def starting_tokenizer(config: RunConfig) -> Any:
    """The starting model's tokenizer as the run will use it (model.chat_template applied), checked
    before any work: it has a chat template and that template tells the model its tools."""
    model_dir = resolve_model_dir(config.model.path)
    tokenizer = load_tokenizer(model_dir, chat_template_override(config.model.chat_template))
    check_tools_reach_the_model(tokenizer, config, str(model_dir))
    return tokenizer
