"""ckvc export --format hf: a tiny Llama (built from a config, no download) committed as a
training state and saved through ckvc.dcp.Writer, exported to a sharded Hugging Face
folder that transformers loads with the trained model's logits, bit for bit; two exports
byte-identical; names mapped and checked."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run

import ckvc
from ckvc.errors import InvalidInputError
from ckvc.integrations.hf_export import INDEX_NAME, export_hf

transformers = pytest.importorskip("transformers")


def tiny_llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # "trained": weights no initializer would give
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model.eval()


def logits(model: Any) -> torch.Tensor:
    ids = torch.arange(16).unsqueeze(0) % 128
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


def files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_training_state_to_sharded_hf_folder(tmp_path: Path) -> None:
    model = tiny_llama()
    model.config.save_pretrained(tmp_path / "cfg")
    repo = ckvc.Repo.init(tmp_path / "r")
    optimizer = torch.optim.Adam(model.parameters())
    repo.commit({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}, "trained")
    out = tmp_path / "hf"
    written = export_hf(repo, "HEAD", out, max_shard_bytes=64 << 10, config_from=tmp_path / "cfg")
    shards = [p for p in written if p.name.startswith("model-")]
    assert len(shards) > 1 and (out / INDEX_NAME) in written and (out / "config.json") in written
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(loaded), logits(model))
    again = tmp_path / "hf2"
    done = run(repo.path, "export", "HEAD", str(again), "--format", "hf", "--max-shard-size", "64KiB",
               "--config", str(tmp_path / "cfg"))  # fmt: skip
    assert done.exit_code == 0, done.output
    assert files(again) == files(out)  # reproducible


def test_dcp_commit_to_hf_folder(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import save as dcp_save

    import ckvc.dcp

    model = tiny_llama()
    repo = ckvc.Repo.init(tmp_path / "r")
    dcp_save({"model": model.state_dict()}, storage_writer=ckvc.dcp.Writer(repo, message="dcp"), no_dist=True)
    out = tmp_path / "hf"
    export_hf(repo, "HEAD", out, config_from=None)
    assert [p.name for p in sorted(out.iterdir())] == ["model.safetensors"]  # one shard: no index
    model.config.save_pretrained(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(loaded), logits(model))


def test_names_mapped_and_checked(tmp_path: Path) -> None:
    repo = ckvc.Repo.init(tmp_path / "r")
    repo.commit({"a.weight": torch.ones(3), "b.weight": torch.zeros(2)}, "flat")
    out = export_hf(repo, "HEAD", tmp_path / "x", fqn_map=lambda n: None if n.startswith("b") else "model." + n)
    from safetensors.torch import load_file

    assert list(load_file(out[0])) == ["model.a.weight"]
    with pytest.raises(InvalidInputError, match="both become"):
        export_hf(repo, "HEAD", tmp_path / "y", fqn_map=lambda n: "same")
    with pytest.raises(InvalidInputError, match="no tensor to export"):
        export_hf(repo, "HEAD", tmp_path / "z", fqn_map=lambda n: None)
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    from ckvc.formats.layout import OutputPathError

    with pytest.raises(OutputPathError, match="not an empty folder"):
        export_hf(repo, "HEAD", busy)
    assert run(repo.path, "export", "HEAD", "o.pt", "--max-shard-size", "1MiB").exit_code == 14


def test_flat_state_dict_tied_weights_and_a_committed_folder(tmp_path: Path) -> None:
    """The model's own state dict (names "model.*" and "lm_head.weight") keeps every name;
    tied embeddings (one storage for two names) export; a committed HF folder exports
    under its tensors' own names."""
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.config.save_pretrained(tmp_path / "cfg")
    repo = ckvc.Repo.init(tmp_path / "r")
    repo.commit(dict(model.state_dict()), "the model's own state dict")
    out = tmp_path / "flat"
    export_hf(repo, "HEAD", out, config_from=tmp_path / "cfg")
    from safetensors.torch import load_file

    names = set(load_file(out / "model.safetensors"))
    assert names == set(model.state_dict()) and "lm_head.weight" in names
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval()), logits(model))
    model.save_pretrained(tmp_path / "folder", max_shard_size="20KB")
    assert run(repo.path, "commit", str(tmp_path / "folder"), "-m", "folder").exit_code == 0
    again = tmp_path / "from-folder"
    export_hf(repo, "HEAD", again, config_from=tmp_path / "folder")
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(again).eval()), logits(model))
