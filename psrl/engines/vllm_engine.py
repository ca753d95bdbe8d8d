"""One vLLM replica: ``AsyncLLM`` in this process, on an asyncio loop of its own.

Callers use anyio on asyncio or trio; every call hops to the engine's loop thread
(``LoopThread``) and back. A request is served as one or more *segments*: when the engine is
paused (for a weight update) vLLM aborts the running segments, and after resume each request is
resubmitted as prompt + tokens so far with the remaining ``max_tokens``. Each token's policy
version comes from vLLM's per-token weight-version spans, so a request that crossed an update
shows the mix. Checking a request and reading a segment's output into it are in ``vllm_requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio

from psrl.config.rollout import EngineConfig

from .base import EngineCounters, EngineStatistics, FinishReason, GenerateRequest, GenerateResult, SamplingParams
from .loop_thread import LoopThread
from .reaper import Reaper, engine_core_processes
from .vllm_args import engine_args, sampling_params
from .vllm_requests import FINISH, ActiveRequest, PartialOutput, read_segment, request_problem
from .local_sync import LocalSender
from .weights import checkpoint_shapes


class VLLMEngine:
    """Implements ``InferenceEngine``. Build with ``launch`` (blocking), ``create`` or ``open``."""

    def __init__(self, name: str, version: int) -> None:
        self.name = name
        self._thread = LoopThread(f"psrl-vllm-{name}")
        self._llm: Any = None
        self.max_model_len = 0
        self.vocab_size = 0
        self._version = version
        self._active: dict[str, ActiveRequest] = {}
        self._paused = False  # new segments wait at the gate in _run_segments
        self._vllm_paused = False  # vLLM itself paused: there were segments in it to stop
        self._vllm_pauses = 0
        self._epoch = 0  # bumped on every pause; a segment aborted in an older epoch is resubmitted
        self._closing = False
        self._closed = False
        self._dead: str | None = None
        self._weight_shapes: dict[str, tuple[int, ...]] = {}
        self.keep_previous = False  # keep a copy of the last whole version to restore (weight_sync.keep_previous)
        self._local = LocalSender()  # update_weights' own sender into this engine's workers
        self._incomplete: str | None = None  # a failed sync left a partial version: stay paused
        self._counters = EngineCounters()
        self._resubmitted = 0
        # The LoRA adapter requests name (vLLM's LoRARequest), set by an adapter sync; None: the base.
        self._adapter: Any = None
        self.serves_adapters = False  # started with lora_rank > 0
        # Engine-loop primitives, created on that loop in _start.
        self._changed: asyncio.Condition | None = None
        self._control: asyncio.Lock | None = None
        self._reaper: Reaper | None = None

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def launch(
        cls, model_path: str, cfg: EngineConfig | None = None, *, dtype: str = "float32", version: int = 0, name: str = "r0",
        lora_rank: int = 0,
    ) -> VLLMEngine:
        """Start an engine, blocking until it serves (~20 s on CPU). For synchronous callers.
        ``lora_rank`` > 0: it serves the trainer's LoRA adapters of that rank (synced as adapters)."""
        engine = cls(name, version)
        engine.serves_adapters = lora_rank > 0
        try:
            engine._thread.run_blocking(engine._start(engine_args(cfg or EngineConfig(), model_path, dtype, lora_rank=lora_rank)))
        except BaseException:
            engine.close()
            raise
        return engine

    @classmethod
    async def create(
        cls, model_path: str, cfg: EngineConfig | None = None, *, dtype: str = "float32", version: int = 0, name: str = "r0",
        lora_rank: int = 0,
    ) -> VLLMEngine:
        engine = cls(name, version)
        engine.serves_adapters = lora_rank > 0
        try:
            await engine._thread.run(engine._start(engine_args(cfg or EngineConfig(), model_path, dtype, lora_rank=lora_rank)))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await engine.aclose()
            raise
        return engine

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, model_path: str, cfg: EngineConfig | None = None, **kwargs: Any) -> AsyncIterator[VLLMEngine]:
        engine = await cls.create(model_path, cfg, **kwargs)
        try:
            yield engine
        finally:
            with anyio.CancelScope(shield=True):
                await engine.aclose()

    async def _start(self, args: Any) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._changed = asyncio.Condition()
        self._control = asyncio.Lock()
        self._weight_shapes = checkpoint_shapes(args.model)
        self._llm = AsyncLLM.from_engine_args(args)
        self._reaper = Reaper(engine_core_processes(self._llm))  # they die with this process
        self.max_model_len = self._llm.model_config.max_model_len
        self.vocab_size = self._llm.model_config.get_vocab_size()
        await self._llm.update_weight_version(str(self._version))
        # The first request pays one-off kernel set-up (seconds on CPU); pay it here.
        from vllm.inputs import TokensPrompt

        warmup = sampling_params(SamplingParams(max_tokens=1), 1)
        async for _ in self._llm.generate(TokensPrompt(prompt_token_ids=[0]), warmup, f"psrl-warmup-{self.name}"):
            pass

    @property
    def llm(self) -> Any:
        """The underlying ``AsyncLLM``; use it only from coroutines run with ``run_in_engine_loop``.
        Requests sent to it directly bypass the pause gate: a pause or weight update does not stop
        them unless requests of ``generate`` are running too."""
        return self._llm

    async def run_in_engine_loop(self, coro: Any) -> Any:
        """Run a coroutine on the engine's own asyncio loop (benchmarks compare against raw vLLM)."""
        return await self._thread.run(coro)

    # ---- InferenceEngine ----------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._closed or self._llm is None:
            return GenerateResult.failed(request.request_id, f"engine {self.name} is closed")
        try:
            return await self._thread.run(self._serve(request))
        except RuntimeError as exc:  # the loop thread stopped under us
            return GenerateResult.failed(request.request_id, f"engine {self.name} is unavailable: {exc}")

    async def abort(self, request_id: str) -> None:
        if not self._closed and self._thread.alive:
            await self._thread.run(self._abort(request_id))

    async def pause(self) -> None:
        await self._thread.run(self._controlled(self._pause))

    async def resume(self) -> None:
        await self._thread.run(self._controlled(self._resume))

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Pause, load the tensors (HF names), reset the prefix cache, bump the version, resume.

        The tensors go to vLLM's worker bucket by bucket through shared memory
        (``local_sync.LocalSender``, then ``receive_weights``). Raises ``ValueError`` before
        anything loads if a tensor does not fit the served model; the version then stays.
        """
        if self._closed:
            raise RuntimeError(f"engine {self.name} is closed")
        await self._local.update(self, named_tensors, version, self._weight_shapes, keep_previous=self.keep_previous)

    async def receive_weights(self, spec: dict[str, Any], version: int, *, final: bool = True) -> None:
        """Pause and load version ``version`` from the trainer's ``WeightSender``(s) named in
        ``spec`` (``psrl.engines.weight_transfer``), then resume at the new version.

        If the sync fails part way, the error (``WeightTransferError``) names the bucket; the
        engine then either restored the previous whole version (``keep_previous``) and serves
        on at the old version, or stays paused, holding no version it could serve, until a later
        sync completes. It never generates from a mixture of versions."""
        if self._closed:
            raise RuntimeError(f"engine {self.name} is closed")
        await self._thread.run(self._controlled(self._receive, {**spec, "name": self.name}, int(version)))

    async def init_weight_group(self, rendezvous: dict[str, Any]) -> None:
        """Every worker joins the weight-broadcast group of ``rendezvous`` (the collective
        transport) as rank ``rendezvous["first_rank"]`` + its own rank; returns once all members
        (the trainer's rank 0 included) have joined."""
        await self._thread.run(self._llm.collective_rpc("psrl_init_collective", args=(dict(rendezvous),)))

    def weight_receivers(self) -> int:
        """How many receivers a sync to this engine has: one per vLLM worker."""
        return int(self._llm.vllm_config.parallel_config.world_size) if self._llm is not None else 1

    def is_alive(self) -> bool:
        llm = self._llm
        return not self._closed and self._dead is None and llm is not None and not llm.errored and self._thread.alive

    def statistics(self) -> EngineStatistics:
        return self._counters.statistics(
            version=self._version,
            requests_in_flight=len(self._active),
            paused=self._paused,
            extra={
                "name": self.name,
                "alive": self.is_alive(),
                "dead_reason": self._dead,
                "segments_resubmitted": self._resubmitted,
                "pauses_with_requests_running": self._vllm_pauses,  # the others paused only our gate
                "incomplete_weight_sync": self._incomplete,
                "adapter": self._adapter.lora_name if self._adapter is not None else None,
                "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size,
            },
        )

    async def aclose(self) -> None:
        """Abort what is in flight (callers get ABORT with the tokens so far) and shut vLLM down."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread.alive and self._llm is not None:
                with anyio.CancelScope(shield=True):
                    await self._thread.run(self._shutdown())
        finally:
            self._thread.stop()
            self._local.close()
            if self._reaper is not None:
                await anyio.to_thread.run_sync(self._reaper.close)

    def close(self) -> None:
        """``aclose`` for synchronous callers (fixtures, scripts)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread.alive and self._llm is not None:
                self._thread.run_blocking(self._shutdown(), timeout=120)
        finally:
            self._thread.stop()
            self._local.close()
            if self._reaper is not None:
                self._reaper.close()

    # ---- on the engine loop -------------------------------------------------------------------

    async def _serve(self, req: GenerateRequest) -> GenerateResult:
        rid = req.request_id
        problem = self._check(req)
        if problem is None and rid in self._active:
            problem = f"request id {rid!r} is already in flight"
        if problem is not None:
            return GenerateResult.failed(rid, problem)
        active = self._active[rid] = ActiveRequest()
        out = PartialOutput([], [], [])
        try:
            result = await self._run_segments(req, active, out)
        except Exception as exc:  # a bug or an unexpected vLLM failure: report it, keep the tokens
            result = out.result(rid, FinishReason.ERROR, f"engine {self.name} failed: {type(exc).__name__}: {exc}")
        finally:
            del self._active[rid]
            self._counters.count_result(len(out.ids))
            await self._notify()
        return result

    async def _run_segments(self, req: GenerateRequest, active: ActiveRequest, out: PartialOutput) -> GenerateResult:
        from vllm.inputs import TokensPrompt

        rid, prompt = req.request_id, req.prompt_ids.tolist()
        for n in range(1 << 30):
            assert self._changed is not None
            async with self._changed:
                await self._changed.wait_for(lambda: not self._paused or active.user_aborted or self._closing)
            if active.user_aborted or self._closing:
                return out.result(rid, FinishReason.ABORT)
            remaining = req.sampling.max_tokens - len(out.ids)
            if remaining <= 0:
                return out.result(rid, FinishReason.LENGTH)
            try:
                params = sampling_params(req.sampling, remaining)
            except ValueError as exc:
                return out.result(rid, FinishReason.ERROR, f"invalid sampling parameters: {exc}")
            segment = active.segment_id = f"{rid}#{n}" if n else rid
            epoch, version, start, adapter = self._epoch, self._version, len(out.ids), self._adapter
            submitted = time.perf_counter()
            stream = self._llm.generate(TokensPrompt(prompt_token_ids=prompt + out.ids), params, segment,
                                        lora_request=adapter)
            try:
                finish, stop, spans = await read_segment(stream, out, active, submitted)
            except Exception as exc:
                out.extend_versions(start, None, version)
                if self._llm.errored:
                    self._dead = f"{type(exc).__name__}: {exc}"
                    return out.result(rid, FinishReason.ERROR, f"engine {self.name} is dead: {self._dead}")
                return out.result(rid, FinishReason.ERROR, f"vLLM rejected the request: {type(exc).__name__}: {exc}")
            finally:
                active.segment_id = None
            # Served adapters: every token of a segment comes from the adapter it names, the
            # version's at submission, even if vLLM took the request in only after a later sync
            # (vLLM's spans would then say the later version).
            out.extend_versions(start, None if self.serves_adapters else spans, version)
            if finish == "abort" and not active.user_aborted and not self._closing and (self._paused or self._epoch != epoch):
                self._resubmitted += 1
                continue  # interrupted by a pause: wait for resume, then continue from here
            if finish in FINISH:
                return out.result(rid, FINISH[finish], stop=stop)
            return out.result(rid, FinishReason.ERROR, f"vLLM ended the request with finish reason {finish!r}")
        raise AssertionError("unreachable")

    def _check(self, req: GenerateRequest) -> str | None:
        """What is wrong with a request, in words, or None."""
        if self._closing or self._closed:
            return f"engine {self.name} is closed"
        if self._dead is not None or (self._llm is not None and self._llm.errored):
            return f"engine {self.name} is dead: {self._dead or 'vLLM engine core died'}"
        return request_problem(req, self.max_model_len, self.vocab_size)

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _abort(self, request_id: str) -> None:
        active = self._active.get(request_id)
        if active is None:
            return
        active.user_aborted = True
        if active.segment_id is not None:
            await self._llm.abort(active.segment_id)
        await self._notify()

    async def _controlled(self, fn: Any, *args: Any) -> None:
        assert self._control is not None
        if self._closing:
            raise RuntimeError(f"engine {self.name} is closed")
        async with self._control:
            await fn(*args)

    async def _pause(self) -> None:
        if self._paused:
            return
        self._paused = True
        self._epoch += 1
        if not any(a.segment_id is not None for a in self._active.values()):
            # Nothing is in vLLM, and the gate holds new segments: pausing vLLM itself would cost
            # ~20 ms a step for nothing (its pause sleeps to flush outputs). Only _run_segments
            # submits (direct users of ``llm`` aside), and it sets a segment's id with no await
            # after the gate.
            return
        # "abort" ends running segments now (their tokens so far stay valid); they are resubmitted
        # after resume, so their remaining tokens are computed from scratch with the new weights.
        await self._llm.pause_generation(mode="abort", clear_cache=True)
        self._vllm_paused = True
        self._vllm_pauses += 1

    async def _resume(self) -> None:
        if not self._paused or self._incomplete is not None:  # a partial version is never served
            return
        if self._vllm_paused:
            await self._llm.resume_generation()
            self._vllm_paused = False
        self._paused = False
        await self._notify()

    async def _receive(self, spec: dict[str, Any], version: int) -> None:
        from .weight_transfer import WeightTransferError

        start = time.perf_counter()
        # Paused only because an earlier sync left a partial version: resumed once this one lands.
        was_paused = self._paused and self._incomplete is None
        await self._pause()
        try:
            results = await self._llm.collective_rpc("psrl_receive_weights", args=(spec,))
            failed = [r for r in results if r.get("error")]
            if failed:
                restored = all(r.get("restored") for r in failed)
                if not restored:
                    self._incomplete = failed[0]["error"]
                raise WeightTransferError(failed[0]["error"], bucket=failed[0].get("bucket"), restored=restored)
            # Cached KV blocks were computed by the old weights.
            if not await self._llm.reset_prefix_cache():  # a request holds KV blocks: recompute them too
                await self._llm.reset_prefix_cache(reset_running_requests=True)
            if spec.get("adapter"):  # requests from now on name the new adapter (worker_ext._AdapterLoader)
                from vllm.lora.request import LoRARequest

                from .worker_ext import adapter_id

                self._adapter = LoRARequest(f"psrl-v{version}", adapter_id(version), f"psrl-memory:{self.name}/v{version}")
            await self._llm.update_weight_version(str(version))
            self._version = version
            self._incomplete = None
        finally:
            if not was_paused:
                await self._resume()
        self._counters.count_update(time.perf_counter() - start)

    async def _shutdown(self) -> None:
        self._closing = True
        try:
            segments = [a.segment_id for a in self._active.values() if a.segment_id is not None]
            if segments and not self._llm.errored:
                await self._llm.abort(segments)
            await self._notify()
            assert self._changed is not None
            with anyio.move_on_after(10):
                async with self._changed:
                    await self._changed.wait_for(lambda: not self._active)
        finally:
            self._llm.shutdown()
            # Drop vLLM's object here, on its own loop: collected at interpreter exit instead, its
            # __del__ runs after module globals are gone and prints a TypeError.
            self._llm = None
