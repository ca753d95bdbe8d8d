"""Runs inside vLLM's worker processes: in-place weight loading for RL weight sync.

vLLM mixes this class into its worker (``AsyncEngineArgs(worker_extension_cls=...)``), so this
module must import without side effects in a fresh process. Methods are reached through
``AsyncLLM.collective_rpc(name, args=...)``; their arguments and results are small JSON-like
metadata. The weights themselves never pass through the RPC: ``psrl_receive_weights`` connects
to the trainer's ``WeightSender`` and loads the buckets as they arrive
(``psrl.engines.weight_transfer``), straight from shared memory, tcp frames, a CUDA IPC buffer
or a collective broadcast into the model's parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class _VllmLoader:
    """``ParamLoader`` over the worker's model: vLLM's own in-place reload (layerwise, with the
    kernel repacking it does), fed by the stream, each tensor checked against the checkpoint."""

    def __init__(self, worker: Any, keep_previous: bool) -> None:
        from psrl.engines.weight_transfer.loaders import PreviousVersion
        from psrl.engines.weights import checkpoint_shapes

        self.worker = worker
        self.model_path = worker.vllm_config.model_config.model
        self.shapes = checkpoint_shapes(self.model_path)
        self.previous = PreviousVersion(self._checkpoint) if keep_previous else None

    def _checkpoint(self) -> dict:
        from pathlib import Path

        from safetensors.torch import load_file

        out: dict = {}
        for file in sorted(Path(self.model_path).glob("*.safetensors")):
            out.update(load_file(str(file)))
        return out

    def _checked(self, stream: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        from psrl.engines.weight_transfer.loaders import check_tensor

        for name, t in stream:
            check_tensor(name, t, self.shapes)
            yield name, t

    def _reload(self, stream: Iterator[tuple[str, Any]]) -> int:
        from vllm.config import set_current_vllm_config

        count = [0]

        def counted() -> Iterator[tuple[str, Any]]:
            for item in stream:
                count[0] += 1
                yield item

        with set_current_vllm_config(self.worker.vllm_config):
            try:
                self.worker.model_runner.reload_weights(weights_iterator=counted())
            except BaseException:
                _abandon_layerwise_reload(self.worker.model_runner.get_model())
                raise
        self.worker._psrl_refresh_cpu_lm_head()
        self.worker._psrl_refresh_cpu_experts()
        return count[0]

    def load(self, stream: Iterator[tuple[str, Any]]) -> int:
        stream = self._checked(stream)
        return self.previous.load(stream, self._reload) if self.previous is not None else self._reload(stream)

    def restore(self) -> bool:
        return self.previous.restore(self._reload) if self.previous is not None else False


KEPT_ADAPTERS = 3  # the newest adapters a worker keeps: vllm_args.lora_args sizes its caches for them


def adapter_id(version: int) -> int:
    """vLLM's LoRA id of the adapter of policy ``version`` (ids start at 1; 0 is no adapter)."""
    return int(version) + 1


class _AdapterLoader:
    """``ParamLoader`` of a served LoRA adapter: the version's PEFT-named tensors are built into
    a vLLM ``LoRAModel`` in memory (no file), added to the worker's adapter cache and activated;
    then every other adapter is dropped. Requests name it by :func:`adapter_id`. Until the new one
    is whole the old one is untouched, so a failed sync leaves the previous version served."""

    def __init__(self, worker: Any, config: dict, version: int) -> None:
        self.worker, self.config, self.version = worker, dict(config), int(version)

    def load(self, stream: Iterator[tuple[str, Any]]) -> int:
        from vllm.lora.peft_helper import PEFTHelper

        manager = getattr(self.worker.model_runner, "lora_manager", None)
        if manager is None:
            raise ValueError("the engine serves no LoRA adapters (start it with the trainer's trainer.lora rank)")
        dtype = manager.lora_config.lora_dtype
        # The stream's tensors are views of buffers the next bucket reuses: copied (and cast) here.
        tensors = {name: t.to(dtype=dtype, copy=True) for name, t in stream}
        helper = PEFTHelper.from_dict(self.config)
        helper.validate_legal(manager.lora_config)
        cache = manager._adapter_manager
        model = cache.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = manager._lora_model_cls.from_lora_tensors(
            lora_model_id=adapter_id(self.version), tensors=tensors, peft_helper=helper, device="cpu", dtype=dtype,
            model_vocab_size=manager.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        cache.remove_adapter(lora.id)  # a retried version
        cache.add_adapter(lora)
        cache.activate_adapter(lora.id)
        # The previous versions' adapters stay (KEPT_ADAPTERS in all): a request submitted just
        # before a pause reaches vLLM after it and still names its own adapter, which must be
        # here (vLLM would otherwise look for it on disk and its engine would die).
        for old in sorted(cache.list_adapters())[:-KEPT_ADAPTERS]:
            cache.remove_adapter(old)
        return len(tensors)

    def restore(self) -> bool:
        return True  # the previous adapter was never touched


def _abandon_layerwise_reload(model: Any) -> None:
    """Undo an in-place reload that stopped part way (vLLM 0.32's layerwise reload, whose
    internals this relies on).

    vLLM moves a layer onto the meta device when the reload starts and back once all its
    tensors came; a reload that fails leaves the layers it had not finished on meta, with
    buffered tensors that a later reload would mix into its own. Here every such layer gets its
    kernel tensors back (their values untouched: the old version) and forgets what it buffered,
    so the next reload (a retry, or the restore of the previous version) starts clean. Layers
    already finished hold the new values: the model is a mixture until then."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
        _place_kernel_tensors,
    )
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
        for tensor in get_layer_tensors(layer).values():
            if hasattr(tensor, "weight_loader"):
                tensor.weight_loader = _get_original_loader(tensor)
        info.reset()


class WeightUpdateExtension:
    """Names are prefixed ``psrl_`` so they cannot clash with the worker's own attributes."""

    def psrl_receive_weights(self, spec: dict) -> dict:
        """Receive and load one version from the sender(s) in ``spec`` (see
        ``psrl.engines.weight_transfer.receiver``). Never raises for a failed sync: returns
        ``{"error", "bucket", "restored"}`` so the engine can tell a restored model (serve on at
        the old version) from a partial one (stay paused)."""
        from psrl.engines.weight_transfer import WeightTransferError
        from psrl.engines.weight_transfer.receiver import receive

        state = self._psrl_state(bool(spec.get("keep_previous", False)))
        adapter = spec.get("adapter")
        loader = _AdapterLoader(self, adapter, int(spec["version"])) if adapter else state["loader"]
        try:
            return receive(state["ctx"], spec, loader, state["readers"], name=spec.get("name", "engine"),
                           connections=state["connections"])
        except WeightTransferError as exc:
            return {"error": str(exc), "bucket": exc.bucket, "restored": exc.restored}

    def psrl_init_collective(self, rendezvous: dict) -> None:
        """Join the broadcast group of trainer rank 0 and the engine workers (collective plane)."""
        from psrl.engines.weight_transfer.collective import CollectiveReader

        state = self._psrl_state(False)
        rank = int(rendezvous["first_rank"]) + int(getattr(self, "rank", 0))
        state["readers"]["collective"] = CollectiveReader.join(rendezvous, rank, self._psrl_device())

    def _psrl_device(self) -> Any:
        import torch

        device = getattr(self, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def _psrl_state(self, keep_previous: bool) -> dict:
        state = getattr(self, "_psrl", None)
        if state is None or state["keep_previous"] != keep_previous:
            import zmq

            from psrl.engines.weight_transfer.planes import IpcReader, ShmReader, TcpReader

            readers = state["readers"] if state is not None else {"shm": ShmReader(), "tcp": TcpReader(), "ipc": IpcReader()}
            if state is None and self._psrl_device().type == "cuda":
                from psrl.engines.weight_transfer.cuda_ipc import CudaIpcReader

                readers["cuda_ipc"] = CudaIpcReader(self._psrl_device())
            state = {
                "ctx": state["ctx"] if state is not None else zmq.Context(),
                "readers": readers,
                "connections": state["connections"] if state is not None else {},
                "loader": _VllmLoader(self, keep_previous),
                "keep_previous": keep_previous,
            }
            self._psrl = state
        return state

    def _psrl_refresh_cpu_experts(self) -> None:
        # On CPU the MoE kernel prepacks the experts into its grouped-GEMM layout once, at the
        # first load; a weight update copies the new weights into the parameters but does not
        # repack them (vLLM 0.32), so the experts kept computing with the old weights (measured:
        # engine vs trainer log-probs 0.015 mean after a sync, 1e-7 with this).
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(experts, "process_weights_after_loading"):
                experts.process_weights_after_loading(module)

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
