"""The Ray launcher's newer pieces: per-rank batch shards (``shards``) and rollout workers as
Ray actors (``rollout_worker``, ``worker_pool``). Absolute imports only: inside this package
``import ray`` still means the Ray library."""
