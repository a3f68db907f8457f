"""What every command's process shares: how it is watched and how it ends.

:mod:`~fedshard_lightning.launch.exits` (one line and an exit status for every failure),
:mod:`~fedshard_lightning.launch.os_faults` (disk full, read-only, no permission),
:mod:`~fedshard_lightning.launch.peer_watch` (the launcher's watch over its DDP workers) and
:mod:`~fedshard_lightning.launch.parse_errors` (a parse error as one line, help as plain text).
"""
