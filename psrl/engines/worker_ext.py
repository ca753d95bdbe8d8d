"""Runs inside vLLM's worker processes: in-place weight loading for RL weight sync.

vLLM mixes this class into its worker (``AsyncEngineArgs(worker_extension_cls=...)``), so this
module must import without side effects in a fresh process. Methods are reached through
``AsyncLLM.collective_rpc(name, args=...)``; tensors given as RPC arguments arrive as nested
lists, so the weights travel as one safetensors blob (bytes) instead.
"""

from __future__ import annotations


class WeightUpdateExtension:
    """Names are prefixed ``psrl_`` so they cannot clash with the worker's own attributes."""

    def psrl_load_weights(self, blob: bytes) -> int:
        """Load HF-named tensors from a safetensors blob into the running model; returns the count."""
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        tensors = load(blob)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        self._psrl_refresh_cpu_lm_head()
        return len(tensors)

    def _psrl_refresh_cpu_lm_head(self) -> None:
        # On CPU, linear layers keep a packed copy of their weight for the GEMM kernel. A tied
        # lm_head shares its weight with the embedding, which the reload refreshes, but its packed
        # copy is not rebuilt: the logits would still come from the old weights.
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        if lm_head is not None and getattr(lm_head, "weight", None) is not None:
            dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
