"""The document-affinity key `RAGCacheClient` sends, for a router in front of many replicas.

A request's key names its first document: documents keep their order in the prompt, so the
first one is the subtree under the tree's root, the longest prefix a key that needs no
knowledge of the replicas' trees can name (keying on two documents would split a popular
first document over replicas). The key is a hash (`rc1-` + 16 hex digits of SHA-256 of the
id), so document ids stay out of the router's logs. It goes in `X-Session-Id`, the first
header vllm-router's `consistent_hash` policy reads (docs/deploy.md, "Many replicas").

The load bound (bounded-load consistent hashing, done by the client because the router has
none): every response names its replica (`X-RAGCache-Replica`). `AffinityKeys` counts the
replicas of the last `window` answers; when a key's replica holds more than
`ceil(load_factor x (recent + 1) / replicas)` of them (replicas: the number the server's
`/v1/rag/config` reports, 1 + its `--peers`, or the number seen if larger), the request is
re-keyed as `<key>#<salt>` with the salt already seen to land on the least-loaded replica,
or with a new salt (at most `max_salts`): a hot document is then served by a second replica
too, while the others keep their documents. The bound holds per client; many clients with
similar mixes bound the whole.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import deque
from collections.abc import Sequence

from ragcache_core.documents import Document

AFFINITY_HEADER = "X-Session-Id"
REPLICA_HEADER = "X-RAGCache-Replica"


def affinity_key(documents: Sequence[Document]) -> str | None:
    """The routing key of a request with `documents` (None without documents)."""
    if not documents:
        return None
    return "rc1-" + hashlib.sha256(documents[0].id.encode()).hexdigest()[:16]


class AffinityKeys:
    """Keys with a client-side load bound (module docstring). Thread-safe; `key_for` and
    `observe` mutate the counts and the salts' known homes."""

    def __init__(
        self, load_factor: float = 1.25, window: int = 64, max_salts: int = 8, replicas: int = 1
    ) -> None:
        if not load_factor >= 1.0 or window < 1 or max_salts < 0:
            raise ValueError("load_factor must be >= 1, window >= 1 and max_salts >= 0")
        self.load_factor = load_factor
        self.replicas = replicas
        self._window = window
        self._max_salts = max_salts
        self._recent: deque[str] = deque()
        self._counts: dict[str, int] = {}
        self._homes: dict[str, str] = {}  # sent key -> replica that answered it last
        self._lock = threading.Lock()

    def key_for(self, base: str) -> str:
        """The key to send for documents keyed `base`: `base`, or a salted one when its
        replica is over the bound."""
        with self._lock:
            home = self._homes.get(base)
            if home is None or self._counts.get(home, 0) < self._capacity():
                return base
            salted = [f"{base}#{j}" for j in range(1, self._max_salts + 1)]
            known = [k for k in salted if k in self._homes]
            if known:
                best = min(known, key=lambda k: self._counts.get(self._homes[k], 0))
                if self._counts.get(self._homes[best], 0) < self._capacity():
                    return best
            fresh = [k for k in salted if k not in self._homes]
            return fresh[0] if fresh else base

    def observe(self, sent_key: str | None, replica: str | None) -> None:
        """One answer came from `replica` for a request sent with `sent_key`."""
        if replica is None:
            return
        with self._lock:
            if sent_key is not None:
                self._homes[sent_key] = replica
            self._recent.append(replica)
            self._counts[replica] = self._counts.get(replica, 0) + 1
            if len(self._recent) > self._window:
                old = self._recent.popleft()
                self._counts[old] -= 1

    def _capacity(self) -> int:
        replicas = max(1, self.replicas, len(self._counts))
        return math.ceil(self.load_factor * (len(self._recent) + 1) / replicas)
