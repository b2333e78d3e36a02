"""Framework integrations over the library: each module imports its framework, so
importing this package imports none of them. torch_nn: ``load_into`` (a commit
restored into a live model, optimizer and scheduler). transformers: ``CkvcCallback``
and ``checkout_for_resume`` (HF Trainer); lightning: ``CkvcCheckpointIO``;
accelerate: ``save_state`` / ``load_state``; runs: what those three share."""
