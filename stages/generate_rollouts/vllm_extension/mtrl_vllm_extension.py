"""mtrl's vLLM worker extension: runs inside the vLLM server mtrl starts (`--worker-extension-cls
mtrl_vllm_extension.CheckpointReload`, this folder on the server's PYTHONPATH), in vLLM's own
environment. It imports vLLM and torch only, never mtrl.

Two parts:
- `CheckpointReload`, a worker extension (`--worker-extension-cls`): its `reload_checkpoint` puts
  a new policy's weights into the running engine in place;
- `idle_without_spinning`, a vLLM general plugin (entry point group `vllm.general_plugins`,
  declared by the `.dist-info` folder beside this file, found on the PYTHONPATH): vLLM loads it in
  every process of the server.

Why the reload needs more than vLLM's own `reload_weights`: that layerwise reload loads every
weight of the checkpoint and re-runs each loaded layer's weight processing (on the CPU build it
re-packs the linear layers' GEMMs). A layer whose weight is not in the checkpoint is not
re-processed: the tied `lm_head` (it shares `embed_tokens`' weight, which a checkpoint stores
once) keeps the packed GEMM built from the old embedding, and the engine samples from a mix of
two policies (logprobs off by whole nats). So after the reload every embedding-kind layer re-runs
its own weight processing from the weight it now holds; on a GPU build that processing is a
no-op. mtrl verifies every update against an HF recompute before the engine generates with it,
whatever this does.
"""

from __future__ import annotations

import time
from typing import Any

NAP_S = 0.0002  # how long a waiting reader sleeps between looks at the queue (~0.25 ms with timer slack)


def idle_without_spinning() -> None:
    """Make vLLM's processes nap, not spin, while they wait for each other.

    Between vLLM's processes (API server, engine core, workers), a reader of a shared-memory
    message queue loops on sched_yield() for 1 s after its last message, and only then waits on
    a socket notification (`SpinCondition`, vLLM 0.32; not configurable). That buys microseconds
    of latency on a GPU node with cores to spare; on a CPU shared with mtrl, every burst of
    generation is followed by a second of busy cores: measured on 2 cores, mtrl's own forward
    passes right after a request ran 45-75x slower (2.7 ms -> 120-200 ms) for that second.
    Here the reader sleeps NAP_S between looks during that second instead. The second and the
    socket wait after it stay as vLLM has them: waking on the socket alone (no busy second)
    stalled generation for seconds at a time (a notification can be missed; the reader then
    waits out its 5 s recheck)."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition.wait, "mtrl_naps", False):
        return  # loaded twice in one process
    spinning_wait = SpinCondition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(NAP_S)
        else:
            spinning_wait(self, timeout_ms)

    wait.mtrl_naps = True  # type: ignore[attr-defined]
    SpinCondition.wait = wait


class CheckpointReload:
    """Mixed into vLLM's worker class: `self` is the worker."""

    def reload_checkpoint(self, weights_path: str) -> dict[str, Any]:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        started = time.perf_counter()
        self.reload_weights(weights_path=weights_path)
        reprocessed = []
        for name, module in self.model_runner.get_model().named_modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                reprocessed.append(name)
        return {"seconds": time.perf_counter() - started, "reprocessed": reprocessed}
