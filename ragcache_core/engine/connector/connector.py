"""`RAGCacheConnector`: vLLM's `KVConnectorBase_V1` hooks, dispatched to the two sides.

vLLM creates one instance per role: SCHEDULER in the engine-core process (`SchedulerSide`)
and WORKER in each worker process (`WorkerSide`). Loaded by
`KVTransferConfig(kv_connector="RAGCacheConnector",
kv_connector_module_path="ragcache_core.engine.connector", ...)`, see
`ConnectorConfig.kv_transfer_config()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ragcache_core.engine.connector.config import ConnectorConfig
from ragcache_core.engine.connector.metadata import StepOps
from ragcache_core.engine.connector.scheduler_side import SchedulerSide
from ragcache_core.engine.connector.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch


class RAGCacheConnector(KVConnectorBase_V1):
    """Executes RAGCache plans inside vLLM; decides nothing (docs/design.md 3.1-3.2)."""

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a dropped store is a future miss, never a correctness problem.
        return False

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from ragcache_core.engine.compat import check_block_pool_hooks

            check_block_pool_hooks()
            if config.host_write == "eviction":
                from ragcache_core.engine.compat import (
                    check_eviction_window_hooks,
                    check_handout_copies,
                )

                check_eviction_window_hooks(back_to_head=config.back_to_head)
                if config.handout:
                    check_handout_copies(kv_cache_config)
            self._scheduler = SchedulerSide(config, block_size)
        else:
            self._worker = WorkerSide(config, block_size)
        self._vllm_config = vllm_config

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from ragcache_core.engine.compat import attention_backend_name

        worker = self._worker_side()
        worker.backend = attention_backend_name(self._vllm_config)
        worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker_side().begin_step()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side().load(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous (done in start_load_kv, before the forward pass)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores run in wait_for_save, once every layer of the step is computed

    def wait_for_save(self) -> None:
        self._worker_side().store(self._step())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().invalid_block_ids()

    def build_connector_worker_meta(self) -> Any:
        return self._worker_side().report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ---- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count = self._scheduler_side().track_and_count_loads(
            request.request_id,
            request.kv_transfer_params,
            int(request.num_prompt_tokens),
            num_computed_tokens,
        )
        return count, False

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        # Gated by `compat.check_block_pool_hooks` at construction.
        self._scheduler_side().bind_block_pool(gpu_block_pool)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side().after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_side().build_step(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().on_worker_report(connector_output.kv_connector_worker_meta)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Stores ran synchronously in an earlier step: vLLM may free the blocks now (the
        # eviction window recorded the keep spans' blocks first).
        from vllm.v1.request import RequestStatus

        aborted = request.status == RequestStatus.FINISHED_ABORTED
        return False, self._scheduler_side().finished(request.request_id, aborted=aborted)

    def reset_cache(self) -> bool:
        # `reset_prefix_cache(reset_connector=True)`: the eviction window lets go of its blocks.
        return self._scheduler_side().release_all()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None

    # ---- helpers -----------------------------------------------------------------------

    def _step(self) -> StepOps:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepOps)
        return meta

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side hook called on the scheduler-side connector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side hook called on the worker-side connector")
        return self._scheduler
