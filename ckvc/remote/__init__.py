"""Remotes: a bare ckvc repository on a Backend (a directory, a bucket), and the
transfers between it and a local repository (docs/DESIGN.md, "Remotes";
layout: docs/FORMAT.md section 18).

- :mod:`ckvc.remote.location`: URLs, the backend each opens, the configured remotes;
- :mod:`ckvc.remote.repository`: a remote opened as a Repository with a local catalog;
- :mod:`ckvc.remote.transfer`: stored records written into new packs as they are
  (reading and verifying records is the store's record engine, :mod:`ckvc.storage.records`);
- :mod:`ckvc.remote.publish`: a commit several nodes wrote, published on the remote;
- :mod:`ckvc.remote.common`: results, remote-tracking refs, the publication rule;
- :mod:`ckvc.remote.push`, :mod:`ckvc.remote.fetch` (and pull), :mod:`ckvc.remote.clone`
  (and ls-remote, fsck of a remote).
"""
