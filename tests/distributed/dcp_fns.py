"""Rank functions for the DCP tests (run by ranks.run_world in spawned processes)."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import describe_state
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

import ckvc.dcp


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The global tensors: 10 rows shard unevenly over 4 ranks (3, 3, 3, 1)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "sharded": torch.randn(10, 24, generator=g),
        "sharded_bf16": torch.randn(8, 12, generator=g).to(torch.bfloat16),
        "replicated": torch.randn(6, 5, generator=g),
    }


def dtensor_state(world: int, seed: int, empty: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors(seed)
    if empty:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {
        "model": {
            "sharded": distribute_tensor(full["sharded"], mesh, [Shard(0)]),
            "sharded_bf16": distribute_tensor(full["sharded_bf16"], mesh, [Shard(0)]),
            "replicated": distribute_tensor(full["replicated"], mesh, [Replicate()]),
        },
        "step": 0 if empty else 41,  # a non-tensor item: torch.save bytes through DCP
    }


def save_dtensors(rank: int, world: int, repo_dir: str, seed: int) -> dict[str, Any]:
    state = dtensor_state(world, seed, empty=False)
    metadata = dcp.save(state, storage_writer=ckvc.dcp.Writer(repo_dir, message=f"world {world}", metrics={"x": 1.0}))
    assert metadata.storage_meta is not None
    return {"id": metadata.storage_meta.checkpoint_id}


def load_dtensors(rank: int, world: int, repo_dir: str, rev: str, seed: int) -> dict[str, Any]:
    """Load into DTensors at this world size (plain tensors at world size 1)."""
    if world == 1:
        state: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in full_tensors(seed).items()}, "step": 0}
    else:
        state = dtensor_state(world, seed, empty=True)
    dcp.load(state, storage_reader=ckvc.dcp.Reader(repo_dir, rev))
    model = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state["model"].items()}
    return {"model": describe_state(model), "step": state["step"]}


def async_save_process_mode(rank: int, world: int, repo_dir: str, seed: int) -> dict[str, Any]:
    """``dcp.async_save`` in process mode: the writer is pickled into DCP's
    checkpoint process (which opens the repository itself)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's daemon group rendezvous stays on loopback
    # "w" is the same on every rank (DCP writes it once); "rank_part" differs per rank.
    state = {"w": _weights(seed), "rank_part": {f"r{rank}": torch.arange(5) + rank}}
    writer = ckvc.dcp.Writer(repo_dir, message="async process")
    future = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    assert isinstance(future, Future)
    metadata = future.result()
    assert metadata.storage_meta is not None
    dist.barrier()
    loaded = {"w": torch.zeros(16, 16), "rank_part": {f"r{rank}": torch.zeros(5, dtype=torch.int64)}}
    dcp.load(loaded, storage_reader=ckvc.dcp.Reader(repo_dir, metadata.storage_meta.checkpoint_id))
    expected = {
        "w": _weights(seed),
        "rank_part": state["rank_part"],
    }
    return {
        "id": metadata.storage_meta.checkpoint_id,
        "loaded": describe_state(loaded),
        "expected": describe_state(expected),
    }


def _weights(seed: int) -> torch.Tensor:
    return torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))


def _fsdp_model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP (FSDP2 ``fully_shard`` per layer above world size 1) after one
    Adam step, the same on every world size (seeded, same batch)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 6))
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _full(value: Any) -> Any:
    """Every DTensor in a state as its full tensor (a collective: same order on every rank)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def save_fsdp(rank: int, world: int, repo_dir: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp_model(world)
    model(torch.randn(5, 12, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    metadata = dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=ckvc.dcp.Writer(repo_dir))
    assert metadata.storage_meta is not None
    full = {"model": _full(model_sd), "optim": _full(optim_sd["state"])}
    return {"id": metadata.storage_meta.checkpoint_id, "full": describe_state(full)}


def load_fsdp(rank: int, world: int, repo_dir: str, rev: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp_model(world)  # fresh: no step taken, so nothing matches until loaded
    model(torch.zeros(1, 12)).sum().backward()
    opt.step()  # creates the optimizer state DCP loads into
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=ckvc.dcp.Reader(repo_dir, rev))  # in place
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"full": describe_state({"model": _full(model_sd), "optim": _full(optim_sd["state"])})}


def save_sharded(rank: int, world: int, repo_dir: str, seed: int) -> dict[str, Any]:
    """Both sharded saves in one world (spawning ranks is most of these tests' time)."""
    return {"dtensor": save_dtensors(rank, world, repo_dir, seed), "fsdp": save_fsdp(rank, world, repo_dir)}


def load_sharded(rank: int, world: int, repo_dir: str, dtensor_rev: str, fsdp_rev: str, seed: int) -> dict[str, Any]:
    return {
        "dtensor": load_dtensors(rank, world, repo_dir, dtensor_rev, seed),
        "fsdp": load_fsdp(rank, world, repo_dir, fsdp_rev),
    }


def save_and_wait_for_hooks(rank: int, world: int, repo_dir: str, seed: int) -> dict[str, Any]:
    from ckvc.hooks import wait_for_hooks

    saved = save_dtensors(rank, world, repo_dir, seed)
    wait_for_hooks()
    return saved


def load_plain_into_dtensors(rank: int, world: int, repo_dir: str, rev: str, seed: int) -> dict[str, Any]:
    """A plain commit (not a DCP save: a state dict, an HF folder's tensors) loaded
    into DTensors at this world size through ckvc.dcp.Reader: each rank its rows."""
    state = dtensor_state(world, seed, empty=True)["model"]
    dcp.load({"model": state}, storage_reader=ckvc.dcp.Reader(repo_dir, rev))  # the commit's paths: model.*
    local_rows = {k: int(v.to_local().shape[0]) for k, v in state.items()}
    return {"model": describe_state({k: v.full_tensor() for k, v in state.items()}), "local_rows": local_rows}


def load_named_into_dtensors(rank: int, world: int, repo_dir: str, rev: str, shapes: dict[str, list[int]]) -> Any:
    """Tensors of the given names and shapes (float32) loaded into DTensors sharded by
    rows over this world, through ckvc.dcp.Reader; their full values described."""
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(torch.zeros(shape), mesh, [Shard(0)]) for k, shape in shapes.items()}
    dcp.load(state, storage_reader=ckvc.dcp.Reader(repo_dir, rev))
    return describe_state({k: v.full_tensor() for k, v in state.items()})


TINY_LLAMA = {
    "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "max_position_embeddings": 32,
}  # fmt: skip


def train_llama_fsdp2(rank: int, world: int, repo_dir: str, config_dir: str) -> dict[str, Any]:
    """A tiny Llama (from its config) trained 3 steps with FSDP2 over this world, saved
    through ckvc.dcp.Writer; rank 0 reports its logits on a fixed input (a collective
    forward: every rank runs it)."""
    import transformers
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    config = transformers.LlamaConfig(**TINY_LLAMA)
    if rank == 0:
        config.save_pretrained(config_dir)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    saved = dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=ckvc.dcp.Writer(repo_dir, message="fsdp2"))
    assert saved.storage_meta is not None
    with torch.no_grad():
        logits = model(torch.arange(12).unsqueeze(0)).logits
    return {"id": saved.storage_meta.checkpoint_id, "logits": logits.tolist() if rank == 0 else None}
