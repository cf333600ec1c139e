"""KV events on the wire: vLLM's format over ZMQ, with sequence numbers, replay and snapshots.

``KVEventPublisher`` turns a store's tier changes (``store.add_tier_listener``)
into ``KVEventBatch`` es on a PUB socket and answers replays; a
``KVEventSubscriber`` follows one publisher into an ``Inventory``. Needs
``pyzmq`` and ``msgspec``.
"""

from tierkv.kvevents.inventory import Inventory
from tierkv.kvevents.publisher import KVEventPublisher, PublisherConfig
from tierkv.kvevents.subscriber import KVEventSubscriber
from tierkv.kvevents.wire import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = ["MEDIA", "AllBlocksCleared", "BlockRemoved", "BlockStored", "Inventory", "KVEventBatch",
           "KVEventPublisher", "KVEventSubscriber", "PublisherConfig"]
