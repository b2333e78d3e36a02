"""``ckvc.dcp``: the torch.distributed.checkpoint storage writer and reader
(ckvc.integrations.dcp), under a short name: ``ckvc.dcp.Writer(repo)``."""

from ckvc.integrations.dcp import Reader, Writer, export_dcp, read_dcp_metadata

__all__ = ["Reader", "Writer", "export_dcp", "read_dcp_metadata"]
