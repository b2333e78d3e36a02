"""The hybrid cache: a local repository in front of remotes (docs/DESIGN.md,
"Hybrid cache"). ``settings`` (hybrid.json: lazy, promisors, budget, auto_push),
``promisor`` (chunks a read lacks, fetched from a remote), ``cache`` (the budget,
eviction, pins), ``backup`` (auto_push in the background) and ``status`` (what
is backed up, never claimed when the remote lacks it)."""
