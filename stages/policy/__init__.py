"""The policy as the stages use it:

    loading.py   the device, the tokenizer, the model, its EOS tokens, the value head; which
                 generation logprobs are exact, the re-score tolerance by dtype
    batching.py  rollouts as sequences, micro-batches, padded / packed / shared-prefix rows, the
                 memory rule of training passes
    scoring.py   logprobs, entropies and values of target tokens; KL estimators

Counting the passes is bookkeeping (runtime/passes.py); saving a trained policy with its AdamW
state is ppo-update's (stages/ppo_update/checkpoint.py).
"""
