"""--model FILE.gguf: a GGUF is converted into a float32 HF folder and imported as the starting
policy, with the source model's logits; what cannot be used is a one-line ModelError.

The GGUF files are written here, from a tiny random Llama and a byte-level BPE vocabulary, the
way llama.cpp's convert_hf_to_gguf.py writes them (tensor names from gguf-py's map, the query and
key rows permuted, the tokenizer as `tokenizer.ggml.*` metadata): no download."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pipeline.models.base_model import convert_gguf, import_base_policy, resolve_model
from pipeline.orchestration.stage_table import POLICY
from pipeline.store.versions import Store
from runtime.hashing import file_digests
from schemas.config import RunConfig
from stages.policy.loading import ModelError, load_model, load_tokenizer

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [*bytes_to_unicode().values(), *("".join(pair) for pair in MERGES), *SPECIAL_TOKENS]
CHAT_TEMPLATE = (  # ChatML with the tools in a system turn (mtrl refuses a template that drops them)
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HEADS, KV_HEADS, LAYERS = 4, 2, 2


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(TOKENS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.5,  # logits of order 1, so that a wrong weight shows
        tie_word_embeddings=False,
        bos_token_id=TOKENS.index("<|im_start|>"),
        eos_token_id=TOKENS.index("<|im_end|>"),
    )
    return LlamaForCausalLM(config).eval()


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp's rotary layout of query/key rows
    (transformers' GGUF reader undoes it)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    path: Path, model: LlamaForCausalLM, chat_template: str | None = CHAT_TEMPLATE, leave_out: str = ""
) -> Path:
    """`model` as an all-F32 llama GGUF with its vocabulary; `leave_out`: a tensor not written."""
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE, as SmolLM2's
    writer.add_token_list(TOKENS)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if token in SPECIAL_TOKENS else gguf.TokenType.NORMAL for token in TOKENS]
    )
    writer.add_token_merges([" ".join(pair) for pair in MERGES])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        module, kind = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(module)}.{kind}"
        weights = tensor.numpy().astype(np.float32)
        if name.endswith("self_attn.q_proj.weight"):
            weights = llama_cpp_permute(weights, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            weights = llama_cpp_permute(weights, config.num_key_value_heads)
        if gguf_name != leave_out:
            writer.add_tensor(gguf_name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The machine's cache of converted GGUF files, empty for each test."""
    monkeypatch.setenv("MTRL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def test_a_gguf_file_is_imported_as_a_float32_policy_with_the_source_models_logits(tmp_path, cache, capsys):
    source = tiny_llama()
    (tmp_path / "models").mkdir()
    gguf_path = write_gguf(tmp_path / "models" / "tiny.gguf", source)
    store = Store(tmp_path / "runs")
    config = RunConfig(model={"path": str(gguf_path)}, store={"runs_dir": tmp_path / "runs"})

    version = import_base_policy(store, config)
    assert "converting" in capsys.readouterr().err
    manifest = store.manifest(POLICY, version)
    assert manifest.iteration == -1 and manifest.imported_from == str(gguf_path)
    policy_dir = store.policy_dir(version)
    policy = load_model(policy_dir, "float32", "cpu")
    assert next(policy.parameters()).dtype == torch.float32
    token_ids = torch.tensor([[*range(0, len(TOKENS), 7), *(TOKENS.index(token) for token in SPECIAL_TOKENS)]])
    with torch.no_grad():
        expected, stored = source(token_ids).logits, policy(token_ids).logits
    torch.testing.assert_close(stored, expected, rtol=0, atol=1e-5)

    tokenizer = load_tokenizer(policy_dir)  # the GGUF's vocabulary, special tokens and chat template
    assert tokenizer.convert_ids_to_tokens(list(range(len(TOKENS)))) == TOKENS
    assert tokenizer.eos_token == "<|im_end|>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "the tin"}], tokenize=False)
    assert rendered == "<|im_start|>user\nthe tin<|im_end|>\n"
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(rendered, add_special_tokens=False)) == [
        *("<|im_start|>", "u", "s", "e", "r", "Ċ", "t", "he", "Ġt", "in", "<|im_end|>", "Ċ")
    ]

    # The folder holding the file is the same model, and its import converts nothing again.
    assert import_base_policy(store, config.with_overrides({"model.path": str(gguf_path.parent)})) == version
    assert "converting" not in capsys.readouterr().err
    (converted,) = cache.iterdir()
    assert resolve_model(str(gguf_path.parent)).folder == converted

    # The version is the hash of the converted files: converted anywhere, they are the same bytes.
    convert_gguf(gguf_path, tmp_path / "a")
    convert_gguf(gguf_path, tmp_path / "b")
    assert file_digests(tmp_path / "a") == file_digests(tmp_path / "b") == manifest.files


def test_what_cannot_be_a_gguf_starting_model_is_a_model_error_naming_it(tmp_path, cache):
    folder = tmp_path / "models"
    folder.mkdir()
    with pytest.raises(ModelError, match="no config.json and no .gguf file"):
        resolve_model(str(folder))
    (folder / "notes.txt").write_text("not a model")
    with pytest.raises(ModelError, match=r"notes.txt: a file but not a .gguf"):
        resolve_model(str(folder / "notes.txt"))
    source = tiny_llama()
    write_gguf(folder / "a.gguf", source)
    write_gguf(folder / "b.gguf", source)
    with pytest.raises(ModelError, match=r"2 .gguf files \(a.gguf, b.gguf\); name the one to use"):
        resolve_model(str(folder))

    (folder / "broken.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(
        ModelError, match=re.escape(f"--model {folder / 'broken.gguf'}: transformers cannot read this GGUF file: ")
    ):
        resolve_model(str(folder / "broken.gguf"))
    missing = write_gguf(folder / "missing.gguf", source, leave_out="blk.1.ffn_down.weight")
    with pytest.raises(ModelError, match=r"no weights for 1 parameter\(s\): model.layers.1.mlp.down_proj.weight$"):
        resolve_model(str(missing))
    assert list(cache.iterdir()) == []  # nothing half-converted is kept

    # Converted, but without a chat template: refused as a folder without one is.
    no_template = write_gguf(folder / "no-template.gguf", source, chat_template=None)
    config = RunConfig(model={"path": str(no_template)}, store={"runs_dir": tmp_path / "runs"})
    with pytest.raises(ModelError, match="the tokenizer has no chat template"):
        import_base_policy(Store(tmp_path / "runs"), config)
