"""Bench-only token clock for vLLM engines, loaded by every Python process whose PYTHONPATH holds this directory.

It does nothing unless NSBENCH_TRACE_DIR is set. Then, in the process that runs a vLLM engine core (whichever path
started it: run-batch, nightshift's engine actor, Ray Data LLM's stage, plain `LLM`), it wraps two scheduler methods
as their modules are imported and writes `engine-<pid>.json` into that directory:

  first_token_at / last_token_at  wall clock (time.time()) of the first and last scheduler step that produced output
                                  tokens: the same instant on every path, independent of how results leave the engine
  tokens                          output tokens the scheduler emitted
  first_result_at / last_result_at / results / first_results
                                  wall clock of the first and last step that finished a request, requests finished,
                                  and how many finished in that first step (fixed cost and rows/s measured by results)
  prefix_queries / prefix_hits    prompt tokens looked up in the prefix cache and found there (new requests, the same
                                  record vLLM's own vllm:prefix_cache_queries/hits counters are made of)
  busy_starts                     wall clock of the first token of each busy spell: the first, and each after the
                                  engine had run out of requests (a warm engine serving run after run: one a run)
  omp_bind                        VLLM_CPU_OMP_THREADS_BIND as the engine saw it
  engine_config                   the engine args in force inside the engine core (vLLM's config objects, after
                                  its defaults), and the device-visibility variables it saw: what really reached
                                  the engine on every path, whichever way it was given them

The file is written at the first token and every time the engine runs out of requests (so the last write is the last
token), and at most every 5 s in between. The cost is a few attribute reads per engine step.

nightshift's fake engine (pipeline/engines/fake.py) gets the same clock, by results: `FakeEngine.generate` is wrapped
to stamp each answer (first/last_token_at = first/last answer, tokens = its completion tokens), and engine_config is
the fake's own args.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("NSBENCH_TRACE_DIR")

if _DIR:
    import importlib.abc
    import importlib.util
    import json
    import sys
    import time

    _state = {
        "pid": os.getpid(),
        "first_token_at": None,
        "last_token_at": None,
        "tokens": 0,
        "steps_with_tokens": 0,
        "busy_starts": [],
        "first_result_at": None,
        "last_result_at": None,
        "results": 0,
        "first_results": 0,
        "prefix_queries": 0,
        "prefix_hits": 0,
        "omp_bind": None,
        "engine_config": None,
    }
    _last_write = [0.0]
    _idle = [True]  # the last step left the engine with no request: the next token starts a busy spell

    def _tokens_at(now: float, idle_after: bool) -> None:
        if _idle[0]:
            _state["busy_starts"].append(now)
        _idle[0] = idle_after

    def _results(now: float, finished: int) -> None:
        if not finished:
            return
        if _state["first_result_at"] is None:
            _state["first_result_at"] = now
            _state["first_results"] = finished
        _state["last_result_at"] = now
        _state["results"] += finished

    def _write() -> None:
        _state["omp_bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        path = os.path.join(_DIR, f"engine-{os.getpid()}.json")
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump(_state, fh, default=str)
            os.replace(tmp, path)
        except OSError:
            pass
        _last_write[0] = time.monotonic()

    def _engine_config(scheduler) -> dict:
        cfg = scheduler.vllm_config
        model, sched, cache, par = (
            cfg.model_config,
            cfg.scheduler_config,
            cfg.cache_config,
            cfg.parallel_config,
        )
        return {
            "max_model_len": model.max_model_len,
            "dtype": str(model.dtype).removeprefix("torch."),
            "enforce_eager": model.enforce_eager,
            "seed": model.seed,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enable_chunked_prefill": sched.enable_chunked_prefill,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "block_size": cache.block_size,
            "num_gpu_blocks": cache.num_gpu_blocks,
            "tensor_parallel_size": par.tensor_parallel_size,
            "pipeline_parallel_size": par.pipeline_parallel_size,
            "device": str(cfg.device_config.device),
            "visible_devices": {
                name: os.environ.get(name)
                for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
            },
        }

    def _patch_scheduler(module) -> None:
        original = module.Scheduler.update_from_output

        def update_from_output(self, scheduler_output, model_runner_output):
            result = original(self, scheduler_output, model_runner_output)
            try:
                tokens = finished = 0
                for outs in result.values():
                    for out in outs.outputs:
                        tokens += len(out.new_token_ids)
                        finished += out.finish_reason is not None
                if tokens:
                    now = time.time()
                    _results(now, finished)
                    first = _state["first_token_at"] is None
                    if first:
                        _state["first_token_at"] = now
                        try:
                            _state["engine_config"] = _engine_config(self)
                        except Exception as exc:  # noqa: BLE001 - another vLLM may name these otherwise
                            _state["engine_config"] = {"error": repr(exc)}
                    _state["last_token_at"] = now
                    _state["tokens"] += tokens
                    _state["steps_with_tokens"] += 1
                    drained = self.get_num_unfinished_requests() == 0
                    _tokens_at(now, drained)
                    if first or drained or time.monotonic() - _last_write[0] > 5:
                        _write()
            except Exception:  # noqa: BLE001 - a bench probe must never disturb the engine
                pass
            return result

        module.Scheduler.update_from_output = update_from_output

    def _patch_kv_manager(module) -> None:
        original = module.KVCacheManager.record_prefix_cache_stats

        def record_prefix_cache_stats(self, request, num_hits):
            try:
                if self.prefix_cache_lookup_enabled(request) and request.num_preemptions == 0:
                    _state["prefix_queries"] += request.num_tokens
                    _state["prefix_hits"] += num_hits
            except Exception:  # noqa: BLE001
                pass
            return original(self, request, num_hits)

        module.KVCacheManager.record_prefix_cache_stats = record_prefix_cache_stats

    def _patch_fake_engine(module) -> None:
        original = module.FakeEngine.generate
        inside = [0]

        async def generate(self, request):
            inside[0] += 1
            try:
                result = await original(self, request)
            finally:
                inside[0] -= 1
            try:
                now = time.time()
                first = _state["first_token_at"] is None
                if first:
                    _state["first_token_at"] = now
                    _state["engine_config"] = dict(self.args)
                _state["last_token_at"] = now
                _state["tokens"] += result.completion_tokens or 0
                _results(now, 1)
                _tokens_at(now, inside[0] == 0)
                if first or inside[0] == 0 or time.monotonic() - _last_write[0] > 5:
                    _write()
            except Exception:  # noqa: BLE001 - a bench probe must never disturb the engine
                pass
            return result

        module.FakeEngine.generate = generate

    _TARGETS = {
        "vllm.v1.core.sched.scheduler": _patch_scheduler,
        "vllm.v1.core.kv_cache_manager": _patch_kv_manager,
        "pipeline.engines.fake": _patch_fake_engine,
    }

    class _PatchingLoader(importlib.abc.Loader):
        def __init__(self, loader, patch) -> None:
            self._loader, self._patch = loader, patch

        def create_module(self, spec):
            return self._loader.create_module(spec)

        def exec_module(self, module) -> None:
            self._loader.exec_module(module)
            try:
                self._patch(module)
            except Exception as exc:  # noqa: BLE001
                print(f"nsbench trace: could not patch {module.__name__}: {exc!r}", file=sys.stderr)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            patch = _TARGETS.get(name)
            if patch is None:
                return None
            for finder in sys.meta_path:
                if finder is self:
                    continue
                spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
                if spec is not None and spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                    return spec
            return None

    sys.meta_path.insert(0, _Finder())
