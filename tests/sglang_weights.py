"""The fake SGLang server's weights (tests/sglang_server.py): what its ModelRunner holds, how weights come
in (from disk, or over a weights-update process group) and how it answers `get_weights_by_name`, rebuilt
from SGLang's source (paths inside the wheel, `sglang/srt/...`, read at 0.5.23 and checked against 0.5.6,
0.5.20 and 0.5.21).

Owns `HeldModel`: a model's parameters under SGLang's names (q/k/v stacked into `qkv_proj`, gate/up into
`gate_up_proj`, as models/llama.py, qwen2.py and qwen3.py hold them), filled from a model directory's
safetensors at launch and by `load_weights` (llama.py: _legacy_load_weights), with a fingerprint the toy
model's tokens depend on; and `WeightGroups`: the groups joined by /init_weights_update_group, joined as
utils/common.py: init_custom_process_group does (real torch.distributed gloo groups), receiving buckets as
model_runner_components/weight_updater.py does (weight_sync/tensor_bucket.py: FlattenedTensorBucket).
Tensor parallelism 1 only. Blocking calls: the server runs them off its event loop.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

# models/llama.py (and qwen2.py, qwen3.py): (param_name, shard_name, shard_id)
STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
# models with a get_weights_by_name (models/llama.py's EntryClass; Qwen2/Qwen3 have none in 0.5.6-0.5.23,
# so model_runner_components/weight_exporter.py: get_weights_by_name logs the AttributeError, answers None)
BY_NAME = ("LlamaForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "MistralForCausalLM")


class HeldModel:
    """A model's parameters as an SGLang server holds them (module docstring)."""

    def __init__(self, config: dict[str, Any], params: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.architecture = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        self.params = params
        self.fingerprint = ""
        self.refresh()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> HeldModel:
        """The launch weights: config.json and every *.safetensors of `model_dir`, stacked."""
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        model = cls(config, {})
        model.params = model._allocate(tensors)
        model.load_weights(tensors.items())
        return model

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (the launch checkpoint's): what a loaded tensor is rounded to."""
        return next(iter(self.params.values())).dtype

    def _allocate(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One parameter per SGLang name, shaped from the checkpoint (SGLang shapes them from the config;
        for a complete checkpoint the two agree)."""
        params: dict[str, torch.Tensor] = {}
        stacked: dict[str, list[torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if self._skipped(name):
                continue
            target = self._stacked_name(name)
            if target is None:
                params[name] = torch.empty_like(tensor)
            else:
                stacked.setdefault(target[0], []).append(tensor)
        for name, parts in stacked.items():
            rows = sum(p.shape[0] for p in parts)
            params[name] = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype)
        return params

    def _skipped(self, name: str) -> bool:
        """llama.py: _legacy_load_weights skips these names."""
        tied = bool(self.config.get("tie_word_embeddings"))
        return "rotary_emb.inv_freq" in name or "projector" in name or (tied and "lm_head.weight" in name)

    @staticmethod
    def _stacked_name(name: str) -> tuple[str, str | int] | None:
        for param, shard, shard_id in STACKED:
            if shard in name:
                return name.replace(shard, param), shard_id
        return None

    def _shard(self, shard_id: str | int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
        """(row offset, rows) of a shard in its stacked parameter (layers/linear.py: QKVParallelLinear and
        MergedColumnParallelLinear weight_loader, TP 1)."""
        if shard_id == "q":
            return 0, heads * head_dim
        if shard_id == "k":
            return heads * head_dim, kv_heads * head_dim
        if shard_id == "v":
            return (heads + kv_heads) * head_dim, kv_heads * head_dim
        inter = int(self.config["intermediate_size"])
        return int(shard_id) * inter, inter

    def _dims(self) -> tuple[int, int, int]:
        c = self.config
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads", heads))
        # llama.py: LlamaAttention takes config.head_dim when there is one
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        return heads, kv_heads, head_dim

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """llama.py: _legacy_load_weights: stacked names into their shard, others copied whole (a shape that
        differs is an AssertionError, weight_utils.py: default_weight_loader), unknown names skipped."""
        heads, kv_heads, head_dim = self._dims()
        for name, tensor in weights:
            if self._skipped(name):
                continue
            target = self._stacked_name(name)
            if target is not None:
                param = self.params.get(target[0])
                if param is None:
                    continue
                offset, rows = self._shard(target[1], heads, kv_heads, head_dim)
                shard = param.narrow(0, offset, rows)
                assert shard.shape == tensor.shape, (
                    f"Attempted to load weight ({tensor.shape}) into parameter ({shard.shape})"
                )
                shard.copy_(tensor)
            elif name in self.params:
                param = self.params[name]
                assert param.shape == tensor.shape, (
                    f"Attempted to load weight ({tensor.shape}) into parameter ({param.shape})"
                )
                param.copy_(tensor)
        self.refresh()

    def refresh(self) -> None:
        """Recompute the fingerprint (a hash of every parameter's name, first and last 64 bytes: cheap at
        any size, and changed by any update that changes a bucket's first tensor)."""
        h = hashlib.blake2b(digest_size=8)
        for name in sorted(self.params):
            raw = self.params[name].reshape(-1).view(torch.uint8)
            h.update(name.encode())
            h.update(raw[:64].numpy().tobytes())
            h.update(raw[-64:].numpy().tobytes())
        self.fingerprint = h.hexdigest()

    def get_weights_by_name(self, name: str, truncate_size: int) -> list[Any] | None:
        """llama.py: get_weights_by_name (TP 1), None where the model class has none or the name is
        unknown (weight_exporter.py logs the error and answers None)."""
        if self.architecture not in BY_NAME:
            return None
        if name == "lm_head.weight" and self.config.get("tie_word_embeddings"):
            name = "model.embed_tokens.weight"
        mapped, shard_id = name, None
        for param_name, weight_name, sid in STACKED:
            if weight_name in name:
                mapped, shard_id = name.replace(weight_name, param_name), sid
                break
        param = self.params.get(mapped)
        if param is None:
            return None
        if shard_id in ("q", "k", "v"):
            heads, kv_heads, _ = self._dims()
            head_dim = int(self.config["hidden_size"]) // heads  # as llama.py computes it, head_dim or not
            offset, rows = self._shard(shard_id, heads, kv_heads, head_dim)
            param = param.narrow(0, offset, rows)
        elif shard_id is not None:
            offset, rows = self._shard(shard_id, 0, 0, 0)
            param = param.narrow(0, offset, rows)
        values: list[Any] = param.to(torch.float32).numpy().tolist()
        return values[:truncate_size]


class WeightGroups:
    """The weights-update groups of one server (weight_updater.py: _model_update_group), by group name."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # torch's default_pg_timeout (30 min) unless the test says otherwise
        self.groups: dict[str, Any] = {}

    def init(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> tuple[bool, str]:
        """weight_updater.py: init_weights_update_group -> utils/common.py: init_custom_process_group: the
        tcp:// rendezvous (a TCPStore client: rendezvous.py: _create_c10d_store), PrefixStore(group_name),
        then distributed_c10d.py: _new_process_group_helper's PrefixStore(f"{group_name}/") and
        PrefixStore("cpu/") before ProcessGroupGloo. Not through the helper itself: several fake servers
        share this process, and the helper registers group names process-wide."""
        from torch._C import _distributed_c10d as c10d
        from torch.distributed import rendezvous

        try:
            if backend != "gloo":
                raise RuntimeError(f"the fake SGLang server runs on CPU: backend {backend!r} is not gloo")
            if group_name in self.groups:
                raise ValueError(
                    "The specified group name has already been created, please use a different group name"
                )
            timeout = datetime.timedelta(seconds=self.timeout_s)
            rank = rank_offset  # + tp_rank, 0 here
            url = f"tcp://{_host(master_address)}:{master_port}"
            store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
            store.set_timeout(timeout)
            prefix = c10d.PrefixStore(
                "cpu/", c10d.PrefixStore(f"{group_name}/", c10d.PrefixStore(group_name, store))
            )
            group = c10d.ProcessGroupGloo(prefix, rank, world_size, timeout=timeout)
            group._set_sequence_number_for_group()
        except Exception as e:  # weight_updater.py catches everything here
            return False, f"Failed to initialize custom process group: {e}."
        self.groups[group_name] = group
        return True, "Succeeded to initialize custom process group."

    def destroy(self, group_name: str) -> tuple[bool, str]:
        """weight_updater.py: destroy_weights_update_group (torch's destroy_process_group shuts the
        backend down: its sockets close)."""
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        _abort(group)
        return True, "Succeeded to destroy custom process group."

    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
    ) -> list[tuple[str, torch.Tensor]]:
        """weight_updater.py: receive_weights_from_distributed: one broadcast per tensor, or with
        load_format "flattened_bucket" one uint8 broadcast of them all (tensor_bucket.py:
        FlattenedTensorBucket.empty / reconstruct_tensors). Raises as SGLang does."""
        from torch._C._distributed_c10d import BroadcastOptions

        assert group_name in self.groups, (
            f"Group {group_name} not in {list(self.groups)}. Please call `init_weights_update_group` first."
        )
        group = self.groups[group_name]
        options = BroadcastOptions()
        options.rootRank = 0
        if load_format == "flattened_bucket":
            layout, offset = [], 0
            for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
                dtype = getattr(torch, dtype_name)
                if any(d < 0 for d in shape):
                    raise ValueError(f"Negative dimension in received tensor {name}: {torch.Size(shape)}")
                if offset % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
                size = math.prod(shape) * dtype.itemsize
                layout.append((name, dtype, tuple(shape), offset, size))
                offset += size
            if not layout:
                raise ValueError("Cannot create empty tensor bucket")
            flat = torch.empty(offset, dtype=torch.uint8)
            group.broadcast([flat], options).wait()
            return [(n, flat[o : o + s].view(d).reshape(sh)) for n, d, sh, o, s in layout]
        weights, works = [], []
        for name, dtype_name, shape in zip(names, dtypes, shapes, strict=False):
            tensor = torch.empty(tuple(shape), dtype=getattr(torch, dtype_name))
            works.append(group.broadcast([tensor], options))
            weights.append((name, tensor))
        for work in works:
            work.wait()
        return weights

    def close(self) -> None:
        """A killed server's groups go with it: their sockets close (a receive in flight fails at once),
        so its peers see the group fail, as when a process dies."""
        for group in self.groups.values():
            _abort(group)
        self.groups.clear()


def weight_files(model_path: str) -> list[str]:
    """The files /update_weights_from_disk would load from `model_path` (model_loader/loader.py:
    DefaultModelLoader._prepare_weights): every *.safetensors in the directory (else every *.bin), sorted,
    all of them (weight_utils.py: filter_duplicate_safetensors_files keeps them all without an index
    file), so a directory holding several versions loads them all in turn. ValueError with SGLang's
    message when it cannot: anything os.path.isdir rejects is taken for a Hugging Face repo id and goes to
    weight_utils.py: download_weights_from_hf, whose HFValidationError text for a local path is given here
    (checked by running that function with HF_HUB_OFFLINE=1); a directory without weight files is
    "Cannot find any model weights with `path`"."""
    if not os.path.isdir(model_path):
        raise ValueError(
            f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{model_path}'. "
            "Use `repo_type` argument if needed."
        )
    for suffix in (".safetensors", ".bin"):
        files = sorted(os.path.join(model_path, n) for n in os.listdir(model_path) if n.endswith(suffix))
        if files:
            return files
    raise ValueError(f"Cannot find any model weights with `{model_path}`")


def _abort(group: Any) -> None:
    """Close a gloo group's connections now (ProcessGroupGloo.abort)."""
    with contextlib.suppress(RuntimeError):
        group.abort()


def _host(address: str) -> str:
    """utils/network.py: NetworkAddress.to_tcp brackets an IPv6 address."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
