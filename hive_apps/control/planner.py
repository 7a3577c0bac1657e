"""The ``hive-planner`` Serve app: a stateless shell around ``plan_deployment``.

Plans run in a worker process with a deadline (``HIVE_PLAN_TIMEOUT_S``): a hostile or broken
model config (a million layers, a malformed header) costs at most that much CPU and answers
422, and the worker is replaced; the planner replica itself never stalls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from pydantic import BaseModel

from hive_apps.core.planning.adapter_source import AdapterCheck, adapter_or_error
from hive_apps.core.planning.planner import plan_deployment
from hive_apps.core.planning.source_profile import load_source_profile, metadata_dir
from hive_apps.core.planning.types import DeviceCapacity, Plan, PlanningError, Rejection
from hive_apps.core.settings import get_settings
from hive_apps.core.spec import AdapterSpec, ModelSpec
from hive_apps.core.weights.types import Manifest

log = logging.getLogger("ray.serve")


class PlanOutcome(BaseModel):
    plan: Plan | None = None
    error: str = ""
    status_code: int = 200
    rejected: list[Rejection] = []
    weights: Manifest | None = None  # the source's listing, when it was read (plans again reuse it)


def plan_or_error(spec: ModelSpec, devices: list[DeviceCapacity],
                  pending: list[ModelSpec] | None = None, as_asked: bool = False,
                  weights: Manifest | None = None, demand_seqs: int | None = None,
                  metadata: Path | None = None) -> PlanOutcome:
    """``pending``: deploys still to be planned after this one (``packing.py``); one whose profile
    cannot be loaded is left out (its own deploy reports why). ``as_asked``: ``spec`` is a body a
    user just sent, so the fields it set are known (a stored spec has every field set). ``weights``:
    the revision the model's deploy pinned (a wake, a heal), planned again without asking its source.
    ``metadata``: where a Hub or S3 source's config files are fetched (None: folder sources only)."""
    manifest = weights
    try:
        profile, manifest = load_source_profile(spec.model, spec.vllm_kwargs, weights, metadata=metadata)
        if as_asked and profile.runner == "pooling" and "max_output_prompt_length" in spec.model_fields_set \
                and spec.max_output_prompt_length != 0:
            return PlanOutcome(status_code=422, error=(
                f"max_output_prompt_length={spec.max_output_prompt_length}, but {spec.model!r} runs as a pooling model "
                "(embeddings, scores), which generates no tokens: set it to 0 or leave it out"))
        others = []
        for p in pending or []:
            try:
                others.append((p, load_source_profile(p.model, p.vllm_kwargs, metadata=metadata)[0]))
            except PlanningError:
                continue
        plan = plan_deployment(spec, devices, profile, pending=others, demand_seqs=demand_seqs)
        return PlanOutcome(plan=plan.model_copy(update={"weights": manifest}), weights=manifest)
    except PlanningError as e:
        return PlanOutcome(error=e.message, status_code=e.status_code, rejected=e.rejected, weights=manifest)
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError, RecursionError, OSError) as e:
        # a config the planner cannot model: the deploy is refused, the planner keeps going
        return PlanOutcome(error=f"the model {spec.model!r} cannot be planned: its config is not one the planner "
                                 f"can model ({type(e).__name__}: {e})", status_code=422, weights=manifest)


def _worker_init(without_torch: bool) -> None:
    """The worker never generates text: transformers imports scikit-learn (and SciPy) for assisted
    generation only when it finds it installed: ~50 MB and up to 2 s per worker here, so it must not.
    Nor does it need torch, which transformers 5's config classes import when installed (~400 MB and
    ~3 s): reading configs works without it (every fixture profiles the same). Only a user's code
    (a hook class, a repository's remote config code) might want it, so it stays when those are on."""
    sys.modules.setdefault("sklearn", None)  # type: ignore[arg-type]  # importlib's find_spec then answers "not installed"
    if without_torch:
        sys.modules.setdefault("torch", None)  # type: ignore[arg-type]


@contextlib.contextmanager
def _without_main_file():
    """A spawned child re-runs the parent's ``__main__`` file's imports (multiprocessing's main
    fix-up); in a Serve replica that is Ray's default_worker.py, i.e. all of Ray: ~70 MB and 1-3 s
    the worker does not use. Hidden while the pool starts its process, which happens in submit()."""
    main = sys.modules["__main__"]
    path = main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


def _warm() -> None:
    """What every first plan imports whatever the model: AutoConfig, and what any family's config
    class pulls in with it (configuration_utils and auto_factory, and torch where it is allowed),
    so no plan's deadline counts it. One family's config, built, imports all of that."""
    from transformers import AutoConfig

    AutoConfig.for_model("llama")


class PlanWorker:
    """One planning process at a time, killed and replaced when a plan outlives its deadline."""

    def __init__(self, timeout_s: float, without_torch: bool = False, demand_seqs: int | None = None,
                 metadata: Path | None = None):
        self.timeout_s = timeout_s
        self.demand_seqs = demand_seqs  # HIVE_DEFAULT_DEMAND_SEQS
        self.metadata = metadata  # the metadata cache in HIVE_WEIGHTS_CACHE (None: folder sources only)
        self.without_torch = without_torch
        self._pool: ProcessPoolExecutor | None = None
        self._one_at_a_time = asyncio.Lock()  # the deadline counts a plan's own time, not its queue
        self.warmed_at: float | None = None  # when the current worker finished its imports

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_worker_init, initargs=(self.without_torch,))
        return self._pool

    async def _ensure_warm(self) -> None:
        """A new worker imports the planner (transformers) first, untimed."""
        if self._pool is None:
            with _without_main_file():  # the pool starts its process in this submit
                warming = asyncio.get_running_loop().run_in_executor(self._executor(), _warm)
            await warming
            self.warmed_at = time.time()

    async def warm_up(self) -> None:
        """Start the worker and its imports now, so the first plan (a deploy, a wake) does not wait
        for them: ~5 s on a 2-core box, most of the hive's own share of a deploy's time."""
        try:
            async with self._one_at_a_time:
                await self._ensure_warm()
        except Exception as e:  # the first plan starts another worker and reports what fails
            log.warning("warming the plan worker failed (the first plan starts a new one): %r", e)
            self._replace()

    def _replace(self) -> None:
        self.warmed_at = None
        pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    async def plan(self, spec: ModelSpec, devices: list[DeviceCapacity],
                   pending: list[ModelSpec] | None = None, as_asked: bool = False,
                   weights: Manifest | None = None) -> PlanOutcome:
        loop = asyncio.get_running_loop()
        try:
            async with self._one_at_a_time:
                await self._ensure_warm()
                return await asyncio.wait_for(loop.run_in_executor(
                    self._executor(), plan_or_error, spec, devices, pending, as_asked, weights, self.demand_seqs,
                    self.metadata),
                    self.timeout_s)
        except TimeoutError:
            self._replace()
            return PlanOutcome(status_code=422, error=(
                f"planning {spec.model!r} took longer than {self.timeout_s:.0f}s (HIVE_PLAN_TIMEOUT_S); "
                "its config is too large or malformed"))
        except BrokenProcessPool:
            self._replace()
            return PlanOutcome(status_code=422, error=f"planning {spec.model!r} crashed the planner's worker")

    async def check_adapter(self, spec: AdapterSpec, base: ModelSpec, base_weights: Manifest | None) -> AdapterCheck:
        """A LoRA adapter read from its source and checked against its base (``adapter_source.py``), in the
        worker under the same deadline as a plan."""
        loop = asyncio.get_running_loop()
        try:
            async with self._one_at_a_time:
                await self._ensure_warm()
                return await asyncio.wait_for(loop.run_in_executor(
                    self._executor(), adapter_or_error, spec, base, base_weights, self.metadata), self.timeout_s)
        except TimeoutError:
            self._replace()
            return AdapterCheck(status_code=422, error=(
                f"checking the adapter {spec.source!r} took longer than {self.timeout_s:.0f}s (HIVE_PLAN_TIMEOUT_S)"))
        except BrokenProcessPool:
            self._replace()
            return AdapterCheck(status_code=422, error=f"checking the adapter {spec.source!r} crashed the planner's worker")

    def close(self) -> None:
        self._replace()


class Planner:
    async def __init__(self):
        settings = get_settings()
        user_code = bool(settings.hook_packages) or settings.trust_remote_code
        self.worker = PlanWorker(settings.plan_timeout_s, without_torch=not user_code,
                                 demand_seqs=settings.default_demand_seqs or None,
                                 metadata=metadata_dir(settings.weights_cache))
        self._warming = asyncio.get_running_loop().create_task(self.worker.warm_up())

    async def plan(self, spec: ModelSpec, devices: list[DeviceCapacity],
                   pending: list[ModelSpec] | None = None, as_asked: bool = False,
                   weights: Manifest | None = None) -> PlanOutcome:
        return await self.worker.plan(spec, devices, pending, as_asked, weights)

    async def check_adapter(self, spec: AdapterSpec, base: ModelSpec, base_weights: Manifest | None) -> AdapterCheck:
        return await self.worker.check_adapter(spec, base, base_weights)


def build(_: dict | None = None):
    from ray import serve

    return serve.deployment(Planner, name="Planner", num_replicas=1, max_ongoing_requests=100,
                            ray_actor_options={"num_cpus": 0}).bind()  # type: ignore[attr-defined]
