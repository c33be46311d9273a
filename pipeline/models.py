"""Where the starting policy comes from: the embedded tiny model, a local HF causal-LM directory,
or a hub id (loading it is stages/policy.py's)."""

from __future__ import annotations

from pathlib import Path

from stages.policy import ModelError

EMBEDDED_POLICY = Path(__file__).resolve().parent / "embedded" / "policy"


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
