"""FSDP2 (`fully_shard`) and HSDP under the agent: the script's device mesh kept on the job's group.

A script builds its mesh and shards its model as usual, `mesh = init_device_mesh("cpu", (2, 2))` and
`fully_shard(layer, mesh=mesh)`, before the job's group exists (on the agent's placeholder group,
which has the job's shape). The mesh's sub-groups belong to one generation of the job's group: when
the group re-forms, they are made again on it, in the same order, so they get the same names, and
every object that holds one (the mesh's registry, FSDP's per-module mesh infos) is pointed at the
new ones. A spare given a slot takes that slot's place in the mesh as it does (its rank and
coordinates).

What each rank holds is its shard: a DTensor's local tensor is what it sends, receives in place and
digests (`job_agent.rank.state`), and ranks holding the same shard are replicas (the replicate
dimension of an HSDP mesh). A step that failed half-way leaves FSDP's per-iteration state
(parameters gathered, gradients half reduced): it is reset (`FSDPModule.reset_iter_state`) and the
gradients dropped before the step is done again.

Sharding must be even: a spare builds its model before it knows which shard it will hold, so every
shard must have the same shape (each sharded dimension divisible by the shard degree); an uneven one
is refused at `track()`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    """The `fully_shard` modules in `model` (none unless the script imported FSDP: importing it
    costs)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    return [] if kind is None else [m for m in model.modules() if isinstance(m, kind)]


class Sharded:
    """The FSDP2 modules of a tracked model, their mesh infos and the meshes those hold."""

    def __init__(self, model: torch.nn.Module, at_collective: Callable[[], None]) -> None:
        self.modules = fsdp_modules(model)
        inside = {id(sub) for m in self.modules for sub in m.modules() if sub is not m}
        self.roots = [m for m in self.modules if id(m) not in inside]
        self._infos: list[Any] = []
        for m in self.modules:
            for group in m._get_fsdp_state()._fsdp_param_groups:
                self._infos += [group.mesh_info, group.post_forward_mesh_info]
                for p in group.fsdp_params:
                    self._infos += [p.mesh_info, p.post_forward_mesh_info]
                    _check_even(p)
        self._infos = list({id(i): i for i in self._infos if i is not None}.values())
        meshes = [mesh for i in self._infos for mesh in (i.mesh, i.spmd_mesh) if mesh is not None]
        self._meshes = list({id(mesh): mesh for mesh in meshes}.values())
        for root in self.roots:
            root.register_forward_pre_hook(
                lambda *_: at_collective() if torch.is_grad_enabled() else None
            )

    def regroup(self) -> None:
        """Make the meshes' sub-groups on the default group just formed (every rank of it at once)
        and point everything that holds one at them."""
        if not self.modules:
            return
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.distributed_c10d import _resolve_process_group

        rank = dist.get_rank()
        renamed: dict[str, str] = {}
        for root in list({id(r): r for r in (m._get_root_mesh() for m in self._meshes)}.values()):
            old = list(root._dim_group_names)
            none = ((None, None),) * len(root._layout)
            new = DeviceMesh._init_process_groups(
                root._layout, root._rank_map, root._mesh_dim_names, none
            )
            renamed.update(zip(old, new, strict=True))
            root._pg_registry = {name: _resolve_process_group(name) for name in new}
        for mesh in self._meshes:
            mesh._dim_group_names = [renamed.get(n, n) for n in mesh._dim_group_names]
            mesh._rank = rank  # a spare built its mesh as rank 0: it is this slot now
            mesh._coordinate_on_dim = mesh._compute_coordinate_on_dim()
        for info in self._infos:
            info.__post_init__()  # re-reads its process groups (and this rank's place in them)

    def reset(self) -> None:
        """After a failed step: FSDP's per-iteration state reset, the step's gradients dropped."""
        for root in self.roots:
            with contextlib.suppress(RuntimeError):  # waiting on the broken group's work may raise
                root.reset_iter_state()
            for p in root.parameters():
                p.grad = None
        # the gathered parameters' gradients too, or the redone step adds to them
        for m in self.modules:
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    if hasattr(p, "_unsharded_param"):
                        p._unsharded_param.grad = None
                    p.unsharded_accumulated_grad = None


def _check_even(p: Any) -> None:
    mesh_info, size = p.mesh_info, p._orig_size
    degree = mesh_info.shard_mesh_size if hasattr(mesh_info, "shard_mesh_size") else 1
    dim = p.fsdp_placement.dim
    if len(size) > dim and size[dim] % degree:
        raise ValueError(
            f"FSDP shards a parameter of shape {tuple(size)} unevenly over {degree} ranks "
            f"(dimension {dim}): torchpass needs every shard the same shape, so that a spare, "
            "built before it knows which shard it will hold, can take any; make that dimension a "
            "multiple of the shard degree (pad it) or shard it along another with fully_shard(..., "
            "shard_placement_fn=...)"
        )
