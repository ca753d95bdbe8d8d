"""``launcher=ray``: every Ray piece of a run, side by side with the local launcher in ``pipeline/``.

``launcher`` (entry point, placement), ``engine`` (engine replicas as actors behind the driver's
Router), ``trainer`` (trainer ranks as actors; per-rank shards planned by ``shards``),
``queue_actors`` (the transfer queue's controller and storage units as actors),
``rollout_worker`` and ``worker_pool`` (rollout workers as actors), ``common`` (actor options,
start-up waits, the cluster context). Modules here use ``import ray`` for the Ray library."""
