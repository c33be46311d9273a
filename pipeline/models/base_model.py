"""Where the starting policy comes from: the embedded tiny model, a local HF causal-LM directory,
a GGUF file (converted into one), or a hub id (loading it is stages/policy/loading.py's); the chat
template it is imported with; and its import into the store, as the policy of iteration -1."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.store.versions import Store, copy_files
from runtime.cache import cache_dir
from runtime.hashing import file_digest, file_digests, version_key
from schemas.config import RunConfig
from schemas.stage import POLICY
from schemas.token_stream import chat_template_hash
from stages.generate_rollouts import check_context_budget
from stages.policy.loading import ModelError, load_tokenizer
from stages.registry import Tasks, check_tools_reach_the_model
from stages.sft import DemonstrationTasks

EMBEDDED_POLICY = Path(__file__).resolve().parent / "embedded" / "policy"
# Templates mtrl ships, by the name model.chat_template gives them.
SHIPPED_TEMPLATES = {"hermes": Path(__file__).resolve().parent / "chat_templates" / "hermes.jinja"}
GGUF_CONVERSION_VERSION = "1"  # the files convert_gguf writes; a new one gives new cache folders


@dataclass(frozen=True)
class StartingModel:
    folder: Path  # a save_pretrained folder: config, weights, tokenizer and chat template
    source: Path  # what --model named: that folder, or the .gguf file converted into it


def resolve_model(path: str | None) -> StartingModel:
    """The starting model's folder, and where it came from."""
    if not path:
        return StartingModel(EMBEDDED_POLICY, EMBEDDED_POLICY)
    local = Path(path).expanduser()
    if not local.exists():
        if local.is_absolute() or path.startswith(".") or path.count("/") != 1:
            raise ModelError(f"--model {path}: no such file or directory (and not a hub id of the form org/name)")
        try:  # a hub id, where the machine can reach a hub
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(path))
        except Exception as exc:
            raise ModelError(f"--model {path}: not a local directory and the hub download failed: {exc}") from None
    gguf = gguf_file(local)
    if gguf is not None:
        return StartingModel(converted_gguf(gguf), gguf)
    if not any((local / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelError(f"--model {local}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return StartingModel(local.resolve(), local.resolve())


def resolve_model_dir(path: str | None) -> Path:
    """A local directory holding config, weights, tokenizer and chat template."""
    return resolve_model(path).folder


def gguf_file(local: Path) -> Path | None:
    """The GGUF file `local` names (the file, or the one .gguf of a folder without config.json);
    None for a save_pretrained folder."""
    if local.is_file():
        if local.suffix != ".gguf":
            raise ModelError(f"--model {local}: a file but not a .gguf; expected a causal-LM directory or a GGUF file")
        return local.resolve()
    if (local / "config.json").is_file():
        return None
    found = sorted(local.glob("*.gguf"))
    if len(found) == 1:
        return found[0].resolve()
    if not found:
        raise ModelError(
            f"--model {local}: no config.json and no .gguf file; expected a save_pretrained causal-LM directory,"
            " a .gguf file or a folder holding one"
        )
    names = ", ".join(p.name for p in found)
    raise ModelError(f"--model {local}: {len(found)} .gguf files ({names}); name the one to use: --model {found[0]}")


@functools.lru_cache(maxsize=8)
def gguf_digest(gguf: Path, size: int, mtime_ns: int) -> dict[str, int | str]:
    """The file's digest, hashed once per process (the CLI's checks and the import each ask)."""
    return file_digest(gguf)


# A GGUF is converted once per machine and library versions, into the cache, not into a temporary
# folder: every start of a run imports the converted folder into its store again (its version is
# the hash of those files, a cache hit when stored), and the CLI's checks and `mtrl eval` read it
# too, so a temporary conversion would dequantize the whole model several times per start, even
# to resume a finished run (1.7 s for a 24M-parameter Q8_0 file here; it grows with the model).
def converted_gguf(gguf: Path) -> Path:
    """The float32 save_pretrained folder of a GGUF file, converted on first use."""
    stat = gguf.stat()
    key = version_key(
        "gguf-conversion",
        GGUF_CONVERSION_VERSION,
        {
            "gguf_file": gguf_digest(gguf, stat.st_size, stat.st_mtime_ns),
            # the reader that dequantizes (transformers, with the gguf package): another version may convert otherwise
            "libraries": {name: metadata.version(name) for name in ("transformers", "gguf", "torch", "safetensors")},
        },
        {},
    )
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf} into a float32 HF folder (once): {folder}", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        convert_gguf(gguf, work)
        try:
            os.rename(work, folder)  # whole or absent: a killed conversion leaves only its .tmp-* folder
        except OSError:
            if not folder.is_dir():  # not a conversion that finished first beside this one
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def convert_gguf(gguf: Path, folder: Path) -> None:
    """Write the model of a GGUF file into `folder` as a plain float32 save_pretrained folder:
    config, generation config, dequantized weights, tokenizer and chat template (when the file
    has one). The same file gives the same bytes, wherever it is converted to."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:  # transformers' GGUF reader raises ValueError, KeyError, NotImplementedError, OSError, ...
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model, loading = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            # every weight unpacked into a plain nn.Linear (where a GGUF kernel could keep it in its
            # blocks, transformers would), and the quantization config dropped: save_pretrained
            # refuses a model that keeps GGUF blocks
            quantization_config=GgufConfig(dequantize=True),
            output_loading_info=True,
        )
    except Exception as exc:
        raise ModelError(
            f"--model {gguf}: transformers cannot read this GGUF file: {type(exc).__name__}: {exc}"
        ) from None
    if loading["missing_keys"]:  # transformers would leave them randomly initialised
        missing = sorted(loading["missing_keys"])
        raise ModelError(
            f"--model {gguf}: the file has no weights for {len(missing)} parameter(s): {', '.join(missing)}"
        )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


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


def check_starting_model(config: RunConfig) -> None:
    """The starting model before any work: it is there, it takes the context budget, its tokenizer has
    a chat template and that template tells the model its tools (ModelError, ValueError)."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(resolve_model_dir(config.model.path))
    starting_tokenizer(config)
    check_context_budget(config.generation.max_context_tokens, model_config.max_position_embeddings)


def starting_tokenizer(config: RunConfig) -> Any:
    """The starting model's tokenizer as the run will use it (model.chat_template applied), checked
    before any work: it has a chat template and that template tells the model its tools."""
    model = resolve_model(config.model.path)
    template = chat_template_override(config.model.chat_template)
    tokenizer = load_tokenizer(model.folder, template)
    mixes = [Tasks.resolve(config)] + ([DemonstrationTasks.resolve(config)] if config.sft.steps > 0 else [])
    check_tools_reach_the_model(tokenizer, mixes, config.generation.enable_thinking, str(model.source))
    return tokenizer


IMPORTED_CODE_VERSION = "1"  # the layout of an imported policy (a save_pretrained folder)


def import_base_policy(store: Store, config: RunConfig) -> str:
    """Store the starting model as the policy version of iteration -1. Its files are copied
    into the store, so the runs dir stands alone: moved or copied to another machine it keeps
    its lineage root. The version is the hash of the files, so the same model imported from
    anywhere is the same version. A GGUF file is imported as the folder it converts to, and the
    manifest names the file."""
    model = resolve_model(config.model.path)
    tokenizer = starting_tokenizer(config)  # fail early, before any work, on a template that hides the tools
    digests = file_digests(model.folder)
    identity: dict[str, Any] = {"source_files": digests}
    if config.model.chat_template is not None:  # the same files with another template: another policy
        identity["chat_template_sha256"] = chat_template_hash(tokenizer)
    version = version_key(POLICY, IMPORTED_CODE_VERSION, identity, {})

    def fill(tmp: Path) -> dict[str, Any]:
        copy_files(model.folder, tmp, digests)
        if config.model.chat_template is None:
            return {"imported_from": str(model.source)}
        tokenizer.save_pretrained(tmp)  # stored with the policy: every stage reads the template from there
        return {"imported_from": str(model.source), "chat_template": config.model.chat_template}

    store.write(POLICY, version, fill, {"iteration": -1, "code_version": IMPORTED_CODE_VERSION})
    return version
