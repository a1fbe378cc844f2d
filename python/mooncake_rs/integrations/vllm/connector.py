"""``MooncakeRsConnector``: vLLM's KV on our store and transfer engine.

Loaded by vLLM from ``--kv-transfer-config '{"kv_connector":"MooncakeRsConnector",
"kv_connector_module_path":"mooncake_rs.integrations.vllm","kv_role":"kv_both",
"kv_connector_extra_config":{"pool":"127.0.0.1:7000","auth_token":"..."}}'`` (the settings:
config.py). vLLM makes one instance in its scheduler process (role SCHEDULER) and one per
worker (role WORKER); each delegates to its side (scheduler.py, worker.py).

Where blocks go (``kv_connector_extra_config.store``): ``"kv-pool"`` (default), this host's
KV pool (``mooncake-rs kv-pool``, worker.py), followed by its peers' events; or ``"pool"``,
the cluster-wide pool of ``mooncake-rs store`` nodes (``DistributedStore``, pool_worker.py,
pool_store.py), one pool every instance reads and writes.

Two uses, one connector:
- a prefix pool (``kv_both``): every instance saves the prompt blocks it computed into
  its host's pool and loads, before computing, the longest prefix any followed pool holds;
- P/D: the prefill instance (request ``kv_transfer_params.do_remote_decode``) saves, and
  its response's ``kv_transfer_params`` name its pool; the decode instance, given those
  params, loads from that pool and computes only the prompt's last partial block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .config import ConnectorSettings
from .metadata import MooncakeRsConnectorMetadata

if TYPE_CHECKING:
    from .scheduler import ConnectorScheduler
    from .pool_worker import PoolConnectorWorker
    from .worker import ConnectorWorker

__all__ = ["MooncakeRsConnector"]


class MooncakeRsConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_vllm(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | PoolConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import ConnectorScheduler

            self._scheduler = ConnectorScheduler(self.settings, self.block_size)
        else:
            if self.settings.uses_pool:  # the cluster-wide pool (DistributedStore)
                from .pool_worker import PoolConnectorWorker

                self._worker = PoolConnectorWorker(self.settings, kv_cache_config.num_blocks)
            else:
                from .worker import ConnectorWorker

                self._worker = ConnectorWorker(self.settings, kv_cache_config.num_blocks)

    # --- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, MooncakeRsConnectorMetadata):
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeRsConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def take_events(self) -> Any:
        if self._scheduler is None:
            return ()
        return self._scheduler.take_events()
