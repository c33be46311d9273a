"""Where the policy a run starts from comes from (base_model.py): the embedded tiny model (embedded/), a local
HF directory, a GGUF file or a hub id, the chat template it is rendered with (chat_templates/), and its import
into the store as the first policy."""
