"""Repository setup and settings: ``ckvc init`` and ``ckvc config``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click

from ckvc.cli.main import Context, cli
from ckvc.cli.output import emit_json, json_option
from ckvc.errors import InvalidInputError


@cli.command()
@click.argument("directory", required=False, default=None)
@click.option("--chunk-size", type=int, default=None, help="Chunk size in bytes (default 4 MiB).")
@click.option("--default-branch", default="main", show_default=True)
@json_option
@click.pass_obj
def init(obj: Context, directory: str | None, chunk_size: int | None, default_branch: str, as_json: bool) -> None:
    """Create a repository in DIRECTORY (default: the current one). On an existing
    repository, like git: it is opened (checked) and left as it is, exit 0."""
    from ckvc.core import REPO_DIR
    from ckvc.repo import Repo

    path = Path(obj.directory, directory) if directory else Path(obj.directory)
    existing = (path / REPO_DIR / "config.json").is_file()
    if existing:
        repo = Repo.open(path)  # refuses a damaged or too new repository
        if chunk_size is not None and chunk_size != repo.config.chunk_size:
            repo.close()
            raise InvalidInputError(
                f"{repo.dir} exists with chunk size {repo.config.chunk_size}; --chunk-size cannot change it"
            )
    else:
        repo = Repo.init(path, chunk_size=chunk_size, default_branch=default_branch)
    repo.close()
    if as_json:
        emit_json({"path": str(repo.dir), "reinitialized": existing})
    elif existing:
        click.echo(f"Reinitialized existing ckvc repository in {repo.dir}")
    else:
        click.echo(f"Initialized empty ckvc repository in {repo.dir}")


@cli.command("config")
@click.argument("key", required=False)
@click.argument("value", required=False)
@json_option
@click.pass_obj
def config_cmd(obj: Context, key: str | None, value: str | None, as_json: bool) -> None:
    """Show the repository config (KEY: that setting), or set reflog_expiry (e.g. 30d), gc_grace (e.g. 1h),
    repack_threshold (0..1), keyframe_interval (1..255; 1 turns deltas off), codec
    (auto, zstd, raw; zstd:LEVEL), cache_size (e.g. 50GiB, unlimited), auto_push
    (a remote, none), hooks.post_commit / hooks.post_push (a shell command, none),
    hooks.timeout (seconds), sign_key (a PEM private key), sign_commits (true/false),
    trusted_keys (a PEM public key, a folder of them, or a list) or require_signatures
    (true/false: every read refuses a commit no trusted key signed)."""
    from ckvc.retention_policy import parse_duration

    repo = obj.repo
    if key is not None and value is not None:
        if key in ("reflog_expiry", "gc_grace"):
            repo.set_config(**{f"{key}_s": parse_duration(value)})
        elif key == "repack_threshold":
            try:
                repo.set_config(repack_threshold=float(value))
            except ValueError:
                raise InvalidInputError(f"repack_threshold must be a number, got {value!r}") from None
        elif key == "keyframe_interval":
            try:
                interval = int(value)
            except ValueError:
                raise InvalidInputError(f"keyframe_interval must be an integer, got {value!r}") from None
            repo.set_config(keyframe_interval=interval)
        elif key in ("cache_size", "auto_push"):
            repo.set_config(**{key: value})
        elif key in ("sign_key", "sign_commits", "trusted_keys", "require_signatures"):
            from ckvc.signing import set_trust

            if key in ("sign_key", "trusted_keys") and value not in ("", "none"):
                value = str(Path(obj.directory, value))
            set_trust(repo.core, key, value)
        elif key.startswith("hooks."):
            from ckvc.hooks import set_hook

            set_hook(repo.core, key.removeprefix("hooks."), value)
        elif key == "codec":
            name, _, level = value.partition(":")
            try:
                codec: dict[str, Any] = {"name": name, **({"level": int(level)} if level else {})}
            except ValueError:
                raise InvalidInputError(f"codec level must be an integer, got {level!r}") from None
            if name == "raw" and level:
                raise InvalidInputError("the raw codec takes no level")
            repo.set_config(codec=codec)
        else:
            raise InvalidInputError(
                f"unknown setting {key!r}; settable: "
                "reflog_expiry, gc_grace, repack_threshold, keyframe_interval, codec, cache_size, auto_push, "
                "hooks.post_commit, hooks.post_push, hooks.timeout, sign_key, sign_commits, trusted_keys, "
                "require_signatures"
            )
    data = dataclasses.asdict(repo.config)
    from ckvc.hybrid.settings import HybridSettings

    hybrid = HybridSettings.load(repo.core)
    data.update(cache_size=hybrid.cache_size, auto_push=hybrid.auto_push, lazy=hybrid.lazy)
    if repo.core.dir is not None:
        from ckvc.hooks import HookSettings

        hooks = HookSettings.load(repo.core.dir)
        data.update({f"hooks.{k}": v for k, v in dataclasses.asdict(hooks).items()})
        from ckvc.signing import TrustSettings

        data.update(dataclasses.asdict(TrustSettings.stored(repo.core.dir)))
    if key is not None:  # `config KEY [VALUE]`: that setting alone, as git config KEY prints it
        stored = f"{key}_s" if key in ("reflog_expiry", "gc_grace") else key
        if stored not in data:
            raise InvalidInputError(f"unknown setting {key!r}; known: {', '.join(sorted(data))}")
        data = {stored: data[stored]}
    if as_json:
        emit_json(data)
    else:
        for k, v in sorted(data.items()):
            click.echo(f"{k} = {json.dumps(v)}")
