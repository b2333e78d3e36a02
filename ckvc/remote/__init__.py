"""Remotes: a bare ckvc repository on a Backend (a directory, a bucket), and the
transfers between it and a local repository (docs/DESIGN.md, "Remotes";
layout: docs/FORMAT.md section 18).

- :mod:`ckvc.remote.location`: URLs, the backend each opens, the configured remotes;
- :mod:`ckvc.remote.repository`: a remote opened as a Repository with a local catalog;
- :mod:`ckvc.remote.transfer`: stored records moved as they are, verified on arrival;
- :mod:`ckvc.remote.sync`: push, fetch, pull, clone, ls-remote.
"""
