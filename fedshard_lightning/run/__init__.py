"""A run on disk: its folder, lock and journal, its FLCache as the trainer uses it, and its model.

:mod:`~fedshard_lightning.run.directory` (creating and finding the run directory, the lock, the
request journal, crash recovery), :mod:`~fedshard_lightning.run.store` (every commit and load of
the algorithm's state), :mod:`~fedshard_lightning.run.fingerprint` (which model, data, algorithm
and seed the cache belongs to), :mod:`~fedshard_lightning.run.request_history` (requests and cache
version agree), :mod:`~fedshard_lightning.run.numerics` (the numerical environment),
:mod:`~fedshard_lightning.run.deployed` and :mod:`~fedshard_lightning.run.checkpoint` (the model a
run hands out: ``model.safetensors``, ``model.ckpt`` and :func:`~fedshard_lightning.load_model`).
"""
