"""Storage layer: packs, the LMDB index, the object store, file helpers and locks."""
