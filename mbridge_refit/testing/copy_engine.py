"""An engine stand-in that loads by copies, for the colocated refit's checks on the CPU: ``CopyEngine``
(one parameter per HF tensor it loads) and ``CopyEngineWorker`` (the ``engines.base.RefitWorker`` RPCs
``engines.ipc.trainer.IpcSession`` calls, over ``engines.ipc.engine.RefitReceiver``). Its state after a refit
is compared with an oracle (the stock export, the checkpoint), never with the trainer's own tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch

from mbridge_refit.engines.base import check_rpc_version
from mbridge_refit.engines.ipc.engine import RefitReceiver

__all__ = ["CopyEngine", "CopyEngineWorker"]


class CopyEngine(torch.nn.Module):
    """An engine of its own: one parameter per HF tensor it loads (dots as ``__``), loaded by copies;
    ``skipped`` names are not the engine's (its adapter says it skips them)."""

    def __init__(self, hf: dict[str, torch.Tensor], skipped: Collection[str] = ()) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict(
            {
                name.replace(".", "__"): torch.nn.Parameter(torch.zeros_like(t), requires_grad=False)
                for name, t in hf.items()
                if name not in skipped
            }
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.params[name.replace(".", "__")].data.copy_(tensor)

    def state(self) -> dict[str, torch.Tensor]:
        return {name.replace("__", "."): p.data for name, p in self.params.items()}


class CopyEngineWorker:
    """The engine's worker: the RPCs of ``engines.base.RefitWorker`` the colocated transport calls."""

    def __init__(self, engine: CopyEngine) -> None:
        self.receiver = RefitReceiver(engine, torch.device("cpu"))

    def mbridge_refit_open(
        self, wire, payload, transport, check, allow_partial, completion=False, go_ahead=None, rpc_version=None
    ):
        check_rpc_version(rpc_version, "open")
        return self.receiver.open(
            wire, payload, transport, check=check, allow_partial=allow_partial, completion=completion, go_ahead=go_ahead
        )

    def mbridge_refit_apply(self, fingerprint, signal=False, go=None):
        return self.receiver.apply(fingerprint, signal=signal, go=go)

    def mbridge_refit_close(self):
        self.receiver.close()
