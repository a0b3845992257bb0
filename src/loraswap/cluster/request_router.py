"""How Ray Serve picks a model replica for a request: the least busy, its adapters breaking ties.

Serve's default router (power of two choices) keeps a request on the replicas holding its
multiplexed model id, and when those are full, its waiting requests retry with a backoff
that grows to 0.5 s each. Whichever wakes first while a slot is free takes it, the newest
(shortest backoff) more often than the oldest, and a replica slot goes to a waiting
request with the same model id before older ones: measured on the H200 with one SDXL
replica and 4 clients, Serve's own share of a request reached 16 s at p99 against 2.2 s at
p50.

For diffusion a generation (seconds) costs far more than taking an adapter in (a read and
a swap, milliseconds to a few hundred), so this router sends each request to the replica
with the fewest requests in flight, preferring among equals one that holds the request's
adapters, then one holding fewer adapter sets. Replicas take as many requests as their GPU
worker queues (`ModelDeploymentConfig.max_ongoing_requests`), so the order among waiting
requests is the worker scheduler's (its fairness bounds), as in one process. Requests wait
at the router only when every replica is full, and leave it oldest first.
"""

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica


class LeastBusyAdapterRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # Serve takes the replica with the shortest queue among one list, the first on a tie
        model_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        holders = self._multiplexed_model_id_to_replica_ids.get(model_id, set()) if model_id else set()
        return [sorted(candidate_replicas,
                       key=lambda r: (r.replica_id not in holders, len(r.multiplexed_model_ids)))]

    def _get_pending_request_matching_metadata(self, request_metadata=None) -> PendingRequest | None:
        # a free slot goes to the oldest waiting request, never to a newer one for the same
        # adapters (FIFOMixin's default), which starved older requests under load
        return None
