"""The DataLoader and everything that runs it (main process and its worker processes).

``dataloader.py`` (the torch subclass and its arguments), ``cursor.py`` (NOTE [ The epoch
cursor ]), ``schedule.py`` (NOTE [ Cross-epoch prefetch ]), ``iterators/`` (the only code that
touches torch internals), ``supervision.py`` (what a worker's death means), ``worker_guard.py``
and ``result_queue.py`` (what runs in each worker to keep it supervised), ``seeding.py``,
``rngs.py`` and ``state_reads.py`` (NOTE [ Seeding contract ]), ``resume.py`` and
``state_checks.py`` (NOTE [ Resume is exact or refused ]), ``setup_warnings.py`` (set-ups that
would go unnoticed).

May import: ``stats``, ``device``, ``sampling``, ``datasets``, ``vision``, ``formats``,
``parent_death``; never ``cli`` or ``lightning``.
"""
