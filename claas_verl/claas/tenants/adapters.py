"""Each tenant's adapter: its lineage (versions 0, 1, 2, ...), the SHA-256 of its weights, and a store that keeps
idle tenants' adapters and optimizer states in host memory and swaps one into the training module for its update.

The trainer's engine holds ONE adapter (verl's LoRA engine is single-adapter; docs/verl-couplings.md): an update of
tenant ``t`` is :meth:`TenantAdapterStore.swap_in` (copy ``t``'s adapter into the module's LoRA parameters and its
AdamW state and learning-rate schedule into the optimizer and its scheduler), the optimizer step(s), then
:meth:`TenantAdapterStore.swap_out` (copy them back to host memory; a changed adapter becomes ``t``'s next version).
Between updates every tenant rests on the CPU. Under FSDP2 each rank keeps its own shards; the digests are of the
whole adapter (gathered), so every rank names a version alike.

The digest (:func:`adapter_digest`) is over the tensors' names (sorted), dtypes, shapes and bytes, so it names the
exact weights: equal digests, equal adapters bit for bit, whatever the device or the dict's order. Replies and
stats name it next to the version.

Checkpoints (:meth:`TenantAdapterStore.save`): one new file per tenant and save (``<tenant>/s<save>-v<version>.pt``:
adapter, optimizer state, lineage) and a ``manifest.json`` written atomically last, naming each tenant's file and
digest. A save killed part way leaves the previous manifest and the files it names, so a resume sees the previous
checkpoint whole; :meth:`load` re-hashes every adapter (shard) against the manifest. A sharded job saves one such
directory per rank.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from claas_verl.claas.tenants.config import check_tenant_names
from claas_verl.utils.files import atomic_write

MANIFEST = "manifest.json"
_FORMAT = 2  # 2: host optimizer state of optimizer_to_host (shards, schedule), shard digests


def adapter_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 hex digest of ``tensors``: for each name in sorted order, the name, dtype, shape and the raw bytes
    (row-major, the device's bits) of its tensor, each field length-prefixed so no two states hash alike."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        header = json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode()
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for part in (header, raw):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
    return h.hexdigest()


def adapter_file_digest(path: str) -> str:
    """:func:`adapter_digest` of the peft adapter directory ``path`` (its ``adapter_model.safetensors``): what a
    serving engine loads, named by the bytes it reads."""
    from safetensors.torch import load_file

    file = os.path.join(str(path), "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} holds no adapter_model.safetensors: save the adapter with safe_serialization")
    return adapter_digest(load_file(file))


def saved_name(name: str, adapter_name: str = "default") -> str:
    """The key PEFT's ``save_pretrained`` writes for the module parameter ``name`` (the adapter's name removed)."""
    return name.replace(f".{adapter_name}", "")


def lora_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """:func:`adapter_digest` of an adapter named as in the module, under the names PEFT saves it with: the digest
    of a tenant's version equals :func:`adapter_file_digest` of the file the serving engine loads."""
    return adapter_digest({saved_name(n): t for n, t in tensors.items()})


def to_host(obj):
    """A deep copy of ``obj`` with every tensor copied to host memory (never a view of a device tensor)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return copy.deepcopy(obj)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) tensor; a plain tensor is its own shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a DTensor: every rank must call it, in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_adapter(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The unsharded adapter of ``params`` in sorted name order (a collective under FSDP2)."""
    return {n: _full(params[n].detach()) for n in sorted(params)}


@dataclass
class TenantAdapter:
    """One tenant at rest: ``adapter`` (name -> CPU tensor: this rank's shard under FSDP2, else the whole tensor),
    ``optimizer`` (:func:`optimizer_to_host`'s dict; None before its first update), ``lineage``: ``[(version,
    digest), ...]``, version 0 the initial adapter, each the :func:`lora_digest` of the WHOLE adapter, and
    ``shard_digest`` of ``adapter`` as stored here (equal to the digest on one rank), which a load re-checks."""

    adapter: dict[str, torch.Tensor]
    optimizer: dict | None = None
    lineage: list[tuple[int, str]] = field(default_factory=list)
    shard_digest: str = ""
    extra: dict = field(default_factory=dict)  # other per-tenant training state, saved with it (e.g. SDPO's EMA)

    @property
    def version(self) -> int:
        return self.lineage[-1][0]

    @property
    def digest(self) -> str:
        return self.lineage[-1][1]


def lora_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The module's trainable parameters by name: what one tenant owns (the LoRA A/B matrices under PEFT)."""
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_to_host(optimizer: torch.optim.Optimizer, lr_scheduler=None) -> dict:
    """The optimizer's per-parameter state as host tensors (``{"state": {index: {key: tensor}}}``, index in
    ``param_groups`` order, this rank's shard of every sharded moment), which 0-dim entries lived on the parameter's
    device (``"on_device"``: AdamW's ``step`` does with ``fused``/``capturable``), each group's ``lr`` and the
    learning-rate scheduler's ``state_dict`` (a tenant's schedule counts its own updates)."""
    state, on_device = {}, {}
    for i, p in enumerate(_optimizer_params(optimizer)):
        entry = optimizer.state.get(p)
        if not entry:
            continue
        state[i] = {k: to_host(_local(v)) if torch.is_tensor(v) else copy.deepcopy(v) for k, v in entry.items()}
        on_device[i] = sorted(k for k, v in entry.items()
                              if torch.is_tensor(v) and v.dim() == 0 and v.device.type != "cpu")
    return {"state": state, "on_device": on_device, "lr": [g["lr"] for g in optimizer.param_groups],
            "lr_scheduler": None if lr_scheduler is None else to_host(lr_scheduler.state_dict())}


def optimizer_from_host(optimizer: torch.optim.Optimizer, saved: dict | None, lr_scheduler=None,
                        fresh: dict | None = None) -> None:
    """Replace the optimizer's state with ``saved`` (:func:`optimizer_to_host`); ``None``: the empty state of a
    tenant before its first update, with ``fresh``'s learning rates and scheduler (the job's initial ones).

    A moment is rebuilt with its parameter's layout (``torch.empty_like``: the same DTensor sharding and device)
    and this rank's stored shard copied in, so the next ``step`` continues exactly where the tenant's last one
    ended."""
    optimizer.state.clear()
    source = saved if saved is not None else fresh
    if saved is not None:
        params = _optimizer_params(optimizer)
        for i, entry in saved["state"].items():
            p = params[int(i)]
            rebuilt = {}
            for k, v in entry.items():
                if not torch.is_tensor(v):
                    rebuilt[k] = copy.deepcopy(v)
                elif v.dim() == 0:
                    rebuilt[k] = v.to(_local(p).device if k in saved["on_device"].get(i, ()) else "cpu", copy=True)
                else:
                    moment = torch.empty_like(p, dtype=v.dtype)
                    if tuple(_local(moment).shape) != tuple(v.shape):
                        raise ValueError(f"optimizer state {k!r} of parameter {i} has shape {tuple(v.shape)}, "
                                         f"this rank's shard {tuple(_local(moment).shape)}: another sharding?")
                    with torch.no_grad():
                        _local(moment).copy_(v)
                    rebuilt[k] = moment
            optimizer.state[p] = rebuilt
    if source is not None:
        for group, lr in zip(optimizer.param_groups, source["lr"], strict=True):
            group["lr"] = lr
        if lr_scheduler is not None and source["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(copy.deepcopy(source["lr_scheduler"]))


class TenantAdapterStore:
    """Every tenant's adapter, optimizer state and lineage in host memory; at most one tenant resident in the
    training module (:attr:`resident`).

    ``initial``: the adapter every tenant starts from (version 0), e.g. ``lora_parameters(model)`` right after the
    adapter was created; each tenant gets its own CPU copy. Under FSDP2 (DTensor parameters) every rank builds its
    own store holding its shards, and every call below is made on all ranks together (the digests gather the whole
    adapter). ``optimizer`` / ``lr_scheduler``: the job's, before any update; their learning rates and schedule are
    where every tenant's first update starts.
    """

    def __init__(self, tenants, initial: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler=None):
        self.tenants = check_tenant_names(tenants, "TenantAdapterStore tenants")
        if not initial:
            raise ValueError("the initial adapter is empty: build the store from the LoRA parameters of the model")
        base = {n: to_host(_local(t)) for n, t in initial.items()}
        digest, shard = lora_digest(full_adapter(initial)), adapter_digest(base)
        self._state = {t: TenantAdapter({n: v.clone() for n, v in base.items()}, None, [(0, digest)], shard)
                       for t in self.tenants}
        self._fresh = None
        if optimizer is not None:
            self._fresh = optimizer_to_host(optimizer, lr_scheduler)
            self._fresh["state"], self._fresh["on_device"] = {}, {}
        self.resident: str | None = None

    def __getitem__(self, tenant: str) -> TenantAdapter:
        try:
            return self._state[tenant]
        except KeyError:
            raise KeyError(f"no tenant {tenant!r} in the adapter store; tenants: {list(self.tenants)}") from None

    def version(self, tenant: str) -> tuple[int, str]:
        """``(version, digest)`` of ``tenant``'s newest adapter."""
        s = self[tenant]
        return s.version, s.digest

    def swap_in(self, tenant: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                lr_scheduler=None) -> None:
        """Make ``tenant`` the resident: its adapter into ``module``'s trainable parameters (same names, this rank's
        shards), its optimizer state and learning-rate schedule into ``optimizer`` / ``lr_scheduler`` (a tenant
        before its first update starts with an empty state and the job's initial schedule)."""
        if self.resident is not None:
            raise RuntimeError(f"tenant {self.resident!r} is still resident: swap_out before swapping in {tenant!r}")
        state = self[tenant]
        params = lora_parameters(module)
        if set(params) != set(state.adapter):
            missing, extra = sorted(set(state.adapter) - set(params)), sorted(set(params) - set(state.adapter))
            raise ValueError(f"tenant {tenant!r}: the module's trainable parameters differ from the stored adapter "
                             f"(missing in the module: {missing[:3]}, not in the adapter: {extra[:3]})")
        with torch.no_grad():
            for name, p in params.items():
                _local(p).copy_(state.adapter[name])
        optimizer_from_host(optimizer, state.optimizer, lr_scheduler, self._fresh)
        self.resident = tenant

    def swap_out(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler=None, digest: str | None = None) -> tuple[int, str]:
        """Copy the resident tenant's adapter, optimizer state and schedule back to host memory and clear the
        optimizer state (no tenant's moments stay on the device); a changed adapter becomes its next version.
        ``digest``: the :func:`lora_digest` of the module's adapter as it is now, when the caller already gathered
        it (else it is gathered and hashed here). Returns ``(version, digest)``."""
        tenant = self.resident
        if tenant is None:
            raise RuntimeError("no tenant is resident: swap_in first")
        state = self._state[tenant]
        params = lora_parameters(module)
        if digest is None:
            digest = lora_digest(full_adapter(params))
        state.optimizer = optimizer_to_host(optimizer, lr_scheduler)
        optimizer.state.clear()
        if digest != state.digest:
            state.adapter = {n: to_host(_local(p)) for n, p in params.items()}
            state.shard_digest = adapter_digest(state.adapter)
            state.lineage.append((state.version + 1, digest))
        self.resident = None
        return state.version, state.digest

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str) -> str:
        """Write every tenant (see the module doc); returns the manifest's path. Idle tenants must not be
        resident (a resident tenant's newest weights live in the module)."""
        if self.resident is not None:
            raise RuntimeError(f"tenant {self.resident!r} is resident: swap_out before saving")
        os.makedirs(directory, exist_ok=True)
        # every save writes new file names (the save's index), so the files the previous manifest names are never
        # overwritten before the new manifest replaces it
        previous = os.path.join(directory, MANIFEST)
        index = 0
        if os.path.exists(previous):
            with open(previous) as f:
                index = int(json.load(f).get("save_index", -1)) + 1
        manifest = {"format": _FORMAT, "save_index": index, "tenants": {}}
        for tenant, state in self._state.items():
            rel = os.path.join(tenant, f"s{index}-v{state.version}.pt")
            payload = {"adapter": state.adapter, "optimizer": state.optimizer, "lineage": state.lineage,
                       "extra": state.extra}
            atomic_write(os.path.join(directory, rel), lambda f, payload=payload: torch.save(payload, f))
            manifest["tenants"][tenant] = {"file": rel, "version": state.version, "digest": state.digest,
                                           "shard_digest": state.shard_digest}
        out = atomic_write(os.path.join(directory, MANIFEST),
                           lambda f: f.write(json.dumps(manifest, indent=1, sort_keys=True).encode()))
        for tenant in self._state:  # files of older versions: no manifest names them any more
            keep = os.path.basename(manifest["tenants"][tenant]["file"])
            for name in os.listdir(os.path.join(directory, tenant)):
                if name.endswith(".pt") and name != keep:
                    os.remove(os.path.join(directory, tenant, name))
        return out

    def load(self, directory: str) -> None:
        """Restore every tenant from :meth:`save`'s directory: same tenants, each adapter re-hashed against the
        manifest. All or nothing."""
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"{directory}/{MANIFEST}: not a tenant adapter checkpoint (format {_FORMAT})")
        saved = sorted(manifest["tenants"])
        if saved != sorted(self.tenants):
            raise ValueError(f"{directory}: the checkpoint holds tenants {saved}, this job has {list(self.tenants)}")
        restored = {}
        for tenant, entry in manifest["tenants"].items():
            payload = torch.load(os.path.join(directory, entry["file"]), map_location="cpu", weights_only=True)
            adapter = payload["adapter"]
            shard = adapter_digest(adapter)
            lineage = [(int(v), str(d)) for v, d in payload["lineage"]]
            if shard != entry["shard_digest"] or lineage[-1] != (entry["version"], entry["digest"]):
                raise ValueError(f"{directory}/{entry['file']}: the adapter hashes to {shard[:12]}, the manifest "
                                 f"says v{entry['version']} {entry['shard_digest'][:12]}: the file is not the "
                                 "saved one")
            restored[tenant] = TenantAdapter(adapter, payload["optimizer"], lineage, shard, payload["extra"])
        self._state = {t: restored[t] for t in self.tenants}
        self.resident = None

    def host_bytes(self) -> dict[str, int]:
        """Bytes each tenant holds in host memory (adapter + optimizer state tensors)."""
        def nbytes(obj) -> int:
            if isinstance(obj, torch.Tensor):
                return obj.numel() * obj.element_size()
            if isinstance(obj, dict):
                return sum(nbytes(v) for v in obj.values())
            if isinstance(obj, (list, tuple)):
                return sum(nbytes(v) for v in obj)
            return 0
        return {t: nbytes(s.adapter) + nbytes(s.optimizer) for t, s in self._state.items()}
