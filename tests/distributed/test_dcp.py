"""ckvc.dcp: torch.distributed.checkpoint through a ckvc repository. DTensor states
saved at world size 4 load bit-exact at 2 and 1 (DCP reshards), plain state_dict
round trips, async_save in thread and process modes, and an unchanged re-save
storing under 1% new bytes."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import dcp_fns
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_state_equal, describe_state, run
from ranks import run_world
from torch.distributed.checkpoint.api import CheckpointException

import ckvc
import ckvc.dcp
from ckvc.errors import InvalidInputError

CHUNK_SIZE = 16 << 10


def _init(tmp_path: Path) -> Path:
    repo_dir = tmp_path / "repo"
    ckvc.Repo.init(repo_dir, chunk_size=CHUNK_SIZE).close()
    return repo_dir


def _pack_bytes(repo_dir: Path) -> int:
    """Bytes of every pack file: what the repository stores, exactly."""
    return sum(p.stat().st_size for p in (repo_dir / ".ckvc" / "packs").rglob("*") if p.is_file())


def _state(seed: int, rows: int = 64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, 256, generator=g)
    return {
        "model": {"weight": weight, "weight_t": weight.t(), "bias": torch.randn(256, generator=g).half()},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(rows, 256, generator=g), "step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "epoch": 3,
        "note": b"\x00raw bytes",
    }  # fmt: skip


def test_dtensor_and_fsdp2_states_saved_at_4_load_bit_exact_at_2_and_1(tmp_path: Path) -> None:
    """DTensors (Shard(0) over 10 rows: 3+3+3+1, Replicate), and an FSDP2 model with
    its Adam state (get_state_dict/set_state_dict), each saved at world size 4 and
    loaded into DTensors at 2 and into plain tensors at 1."""
    repo_dir = _init(tmp_path)
    saved = run_world(4, dcp_fns.save_sharded, (str(repo_dir), 7))
    (dtensor_id,) = {r["dtensor"]["id"] for r in saved}
    (fsdp_id,) = {r["fsdp"]["id"] for r in saved}
    expected_fsdp = saved[0]["fsdp"]["full"]
    assert all(r["fsdp"]["full"] == expected_fsdp for r in saved)
    assert any(k.startswith("/optim/") and k.endswith("/exp_avg") for k in expected_fsdp)
    expected = {"model": describe_state(dcp_fns.full_tensors(7)), "step": 41}
    for world in (2, 1):
        for result in run_world(world, dcp_fns.load_sharded, (str(repo_dir), dtensor_id, fsdp_id, 7)):
            assert result["dtensor"] == expected
            assert result["fsdp"]["full"] == expected_fsdp
    with ckvc.Repo.open(repo_dir) as repo:
        assert repo.head() == ("main", fsdp_id)
        assert repo.read_commit(fsdp_id).parents == (dtensor_id,)
        commit = repo.read_commit(dtensor_id)
        assert (commit.message, commit.metrics, commit.metadata) == ("world 4", {"x": 1.0}, {"dcp": {"world_size": 4}})
        shown = [t.path for t in repo.show(dtensor_id).tensors]
        # four shards of "sharded"; "replicated" once (DCP dedups it)
        assert sum(1 for t in shown if t.startswith("tensors.model.sharded.shards.")) == 4
        assert sum(1 for t in shown if t.startswith("tensors.model.replicated.shards.")) == 1
        assert repo.fsck().ok


def test_plain_state_dict_round_trip_and_history(tmp_path: Path) -> None:
    repo_dir = _init(tmp_path)
    state = _state(1)
    with ckvc.Repo.open(repo_dir) as repo:
        writer = ckvc.dcp.Writer(repo, message="epoch 3", metrics={"val_loss": 0.25}, branch="dcp-run")
        metadata = dcp.save(state, storage_writer=writer, no_dist=True)
        assert metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id == writer.commit_id
        assert repo.resolve("dcp-run") == writer.commit_id
        assert repo.head() == ("main", None)  # the save went to its branch; HEAD stays
        loaded = _state(2)
        dcp.load(loaded, storage_reader=ckvc.dcp.Reader(repo, "dcp-run"), no_dist=True)
        assert_state_equal(loaded, _state(1))
        assert loaded["model"]["weight_t"].stride() == (1, 256)  # written into the non-contiguous view in place
        # the commit is an ordinary one: show and diff see its tensors
        shown = {t.path for t in repo.show("dcp-run").tensors}
        assert "tensors.model.weight.shards.0.data" in shown
        dcp.save(_state(3), storage_writer=ckvc.dcp.Writer(repo, message="epoch 4", branch="dcp-run"), no_dist=True)
        changed = {c.path for c in repo.diff("dcp-run~1", "dcp-run").changed}
        assert "tensors.model.weight.shards.0.data" in changed
        assert [c.message for c in repo.log("dcp-run")] == ["epoch 4", "epoch 3"]
        assert repo.fsck().ok


def test_unchanged_resave_stores_under_one_percent_new_bytes(tmp_path: Path) -> None:
    repo_dir = _init(tmp_path)
    state = _state(4, rows=1024)  # 2 MiB of tensors
    with ckvc.Repo.open(repo_dir) as repo:
        dcp.save(state, storage_writer=ckvc.dcp.Writer(repo, message="first"), no_dist=True)
        first = _pack_bytes(repo_dir)
        dcp.save(state, storage_writer=ckvc.dcp.Writer(repo, message="again"), no_dist=True)
        again = _pack_bytes(repo_dir) - first
    assert 0 < again <= 0.01 * first, (again, first)


def test_async_save_thread_mode(tmp_path: Path) -> None:
    repo_dir = _init(tmp_path)
    state = _state(5)
    with ckvc.Repo.open(repo_dir) as repo:
        future = dcp.async_save(state, storage_writer=ckvc.dcp.Writer(repo, message="async"), no_dist=True)
        assert isinstance(future, Future)
        metadata = future.result()
        assert metadata.storage_meta is not None
        loaded = _state(6)
        dcp.load(loaded, storage_reader=ckvc.dcp.Reader(repo, metadata.storage_meta.checkpoint_id), no_dist=True)
        assert_state_equal(loaded, _state(5))


def test_async_save_process_mode(tmp_path: Path) -> None:
    repo_dir = _init(tmp_path)
    results = run_world(2, dcp_fns.async_save_process_mode, (str(repo_dir), 8))
    assert len({r["id"] for r in results}) == 1
    for r in results:
        assert r["loaded"] == r["expected"]


def test_refusals(tmp_path: Path) -> None:
    repo_dir = _init(tmp_path)
    with ckvc.Repo.open(repo_dir) as repo:
        plain = repo.commit({"w": torch.ones(3)})
        loaded = {"w": torch.zeros(3)}  # a plain commit reads too (each tensor one whole chunk)
        dcp.load(loaded, storage_reader=ckvc.dcp.Reader(repo, plain), no_dist=True)
        assert torch.equal(loaded["w"], torch.ones(3))
        with pytest.raises(CheckpointException, match="Missing key"):
            dcp.load({"v": torch.zeros(3)}, storage_reader=ckvc.dcp.Reader(repo, plain), no_dist=True)
        with pytest.raises(InvalidInputError, match="pass branch="):
            dcp.save({"w": torch.ones(3)}, checkpoint_id="x", storage_writer=ckvc.dcp.Writer(repo), no_dist=True)
        with pytest.raises(InvalidInputError, match="use_collectives=False"):
            dcp.save({"w": torch.ones(3)}, storage_writer=ckvc.dcp.Writer(repo), no_dist=True, use_collectives=False)
        with pytest.raises(ckvc.InvalidRefNameError):
            ckvc.dcp.Writer(repo, branch="bad..name")
        assert repo.head() == ("main", plain)


class _DroppingWriter(ckvc.dcp.Writer):
    """Loses the result of its last item, as a buggy storage layer would."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        results = super().write_data(plan, planner).wait()
        return _done_future(results[:-1])


def _done_future(value: Any) -> Any:
    from torch.futures import Future as TorchFuture

    fut: TorchFuture[Any] = TorchFuture()
    fut.set_result(value)
    return fut


def test_metadata_naming_an_unwritten_shard_commits_nothing(tmp_path: Path) -> None:
    repo_dir = _init(tmp_path)
    with ckvc.Repo.open(repo_dir) as repo:
        with pytest.raises(CheckpointException, match="no rank wrote"):
            dcp.save(_state(7), storage_writer=_DroppingWriter(repo, message="lost"), no_dist=True)
        assert repo.head() == ("main", None)
        assert repo.fsck().ok


def test_export_writes_a_plain_dcp_directory(tmp_path: Path) -> None:
    repo_dir = _init(tmp_path)
    with ckvc.Repo.open(repo_dir) as repo:
        writer = ckvc.dcp.Writer(repo, message="to leave")
        dcp.save(_state(8), storage_writer=writer, no_dist=True)
        assert writer.commit_id is not None
        out = tmp_path / "plain"
        ckvc.dcp.export_dcp(repo, writer.commit_id, out)
        assert (out / ".metadata").is_file() and list(out.glob("*.distcp"))
        loaded = _state(9)
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
        assert_state_equal(loaded, _state(8))
        with pytest.raises(InvalidInputError, match="not an empty directory"):
            ckvc.dcp.export_dcp(repo, writer.commit_id, out)
    # The CLI's checkout -o and export write a DCP commit the same way (HEAD moves only for checkout).
    for args in (["checkout", "main", "-o", "by-checkout"], ["export", "main", "by-export"]):
        done = run(repo_dir, *args)
        assert done.exit_code == 0, done.output
        cli_out = repo_dir / args[-1]
        assert sorted(p.name for p in cli_out.iterdir()) == sorted(p.name for p in out.iterdir())
        loaded = _state(9)
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(cli_out)), no_dist=True)
        assert_state_equal(loaded, _state(8))


@pytest.mark.parametrize("on_conflict", ["retry", "fail"])
def test_another_writer_moving_the_branch_during_a_save(tmp_path: Path, on_conflict: str) -> None:
    """The branch moves forward between planning (where the save reads it) and the
    commit: retry goes on top, fail is a RefConflictError with advice, nothing committed."""
    with ckvc.Repo.init(tmp_path / "r") as repo:
        first = repo.commit({"start": torch.zeros(2)}, message="start")
        writer = ckvc.dcp.Writer(repo, message="dcp", on_conflict="retry" if on_conflict == "retry" else "fail")
        original = writer.finish

        def finish_after_another_writer(*args: Any, **kwargs: Any) -> None:
            with ckvc.Repo.open(tmp_path / "r") as other:
                interloper.append(other.commit({"other": torch.ones(3)}, message="another writer"))
            original(*args, **kwargs)

        interloper: list[str] = []
        writer.finish = finish_after_another_writer  # type: ignore[method-assign]
        if on_conflict == "retry":
            metadata = dcp.save(_state(5), storage_writer=writer, no_dist=True)
            assert metadata.storage_meta is not None
            landed = metadata.storage_meta.checkpoint_id
            assert [c.id for c in repo.log("main")] == [landed, interloper[0], first]
            loaded = _state(0)
            dcp.load(loaded, storage_reader=ckvc.dcp.Reader(repo, str(landed)), no_dist=True)
            assert_state_equal(loaded, _state(5))
        else:
            with pytest.raises(CheckpointException, match="RefConflictError: another writer moved main") as info:
                dcp.save(_state(5), storage_writer=writer, no_dist=True)
            assert "on_conflict='retry'" in str(info.value)
            assert [c.id for c in repo.log("main")] == [interloper[0], first]


def test_a_plain_commit_loads_into_dtensors_at_world_size_2(tmp_path: Path) -> None:
    """Any commit, not only a DCP save (here a plain state dict, as an HF folder's
    tensors are), loads through ckvc.dcp.Reader into DTensors sharded over 2 gloo
    ranks, bit-exact, each rank holding its own rows; and with no_dist at world size 1,
    views of a shared buffer included."""
    repo_dir = tmp_path / "repo"
    full = dcp_fns.full_tensors(5)
    with ckvc.Repo.init(repo_dir) as repo:
        commit_id = repo.commit({"model": full, "step": 3}, "a plain state dict")
    results = run_world(2, dcp_fns.load_plain_into_dtensors, (str(repo_dir), commit_id, 5))
    for r in results:
        assert r["model"] == describe_state(full)
    assert [r["local_rows"]["sharded"] for r in results] == [5, 5]
    shared = torch.arange(20.0)
    with ckvc.Repo.open(repo_dir) as repo:
        views = repo.commit({"head": shared[:5], "tail": shared[12:], "all": shared}, "views of one buffer")
        target = {"head": torch.empty(5), "tail": torch.empty(8), "all": torch.empty(20)}
        dcp.load(target, storage_reader=ckvc.dcp.Reader(repo, views), no_dist=True)
        assert torch.equal(target["tail"], shared[12:]) and torch.equal(target["head"], shared[:5])


def test_a_committed_hf_folder_loads_into_dtensors_at_world_size_2(tmp_path: Path) -> None:
    """A Hugging Face model folder (sharded safetensors, as save_pretrained writes it)
    committed with `ckvc commit`, loaded through ckvc.dcp.Reader into DTensors over 2
    gloo ranks under the model's own names, bit-exact."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf", max_shard_size="8KB", safe_serialization=True)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    repo_dir = _init(tmp_path)
    assert run(repo_dir, "commit", str(tmp_path / "hf"), "-m", "hf folder").exit_code == 0
    with ckvc.Repo.open(repo_dir) as repo:
        rev = repo.resolve("HEAD")
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    shapes = {k: list(v.shape) for k, v in state.items()}
    results = run_world(2, dcp_fns.load_named_into_dtensors, (str(repo_dir), rev, shapes))
    expected = describe_state(state)
    assert all(r == expected for r in results)


def test_fsdp2_training_at_world_size_2_exports_to_a_loadable_hf_folder(tmp_path: Path) -> None:
    """A tiny Llama trained with FSDP2 over 2 gloo ranks and saved through
    ckvc.dcp.Writer; export --format hf; transformers loads the folder and gives the
    trained model's logits."""
    transformers = pytest.importorskip("transformers")
    from ckvc.integrations.hf_export import export_hf

    repo_dir = _init(tmp_path)
    results = run_world(2, dcp_fns.train_llama_fsdp2, (str(repo_dir), str(tmp_path / "cfg")))
    out = tmp_path / "hf"
    with ckvc.Repo.open(repo_dir) as repo:
        export_hf(repo, results[0]["id"], out, max_shard_bytes=16 << 10, config_from=tmp_path / "cfg")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = loaded(torch.arange(12).unsqueeze(0)).logits
    assert torch.allclose(got, torch.tensor(results[0]["logits"]), rtol=0, atol=1e-6)
