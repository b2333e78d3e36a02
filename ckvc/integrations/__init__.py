"""Framework integrations over the library: each module imports its framework, so
importing this package imports none of them (``load_into``, a commit restored into
a live model, optimizer and scheduler, is ckvc.restore). transformers: ``CkvcCallback``
and ``checkout_for_resume`` (HF Trainer); lightning: ``CkvcCheckpointIO``;
accelerate: ``save_state`` / ``load_state``; runs: what those three share."""

from __future__ import annotations

# The commit metadata key under which ckvc.dcp stores DCP's Metadata: here, so
# that the CLI can tell a DCP commit without importing torch.distributed (about 1 s).
DCP_METADATA_KEY = "dcp"
