"""The optimizer's update on a side stream, stage by stage in the forward's order, so that it runs
under the next step's forward instead of after the backward.

    optimizer.beside_forward = UpdateBesideForward(model, params)   # build_optimizer does, where it applies
    optimizer.step()      # TritonAdamW: queues each stage's update on the side stream and returns
    loss = model(...)     # each stage's forward first waits for its own stage's update only
    settle_updates(optimizer)  # before anything else reads the parameters or the optimizer state

Why: AdamW over float32 master weights and moments streams ~30 bytes per parameter (25 ms per
step for the 8-layer mula-7b-a1b on an H200, at HBM bandwidth), while the forward is bound by
tensor-core math and, in eager dispatch, by the host's launches; run one after the other the GPU
does one of the two at a time. Here the update of the embedding is queued first,
then each block's, then the final norm's with the LM head's, each followed by an event; a forward
pre-hook on each stage makes the current stream wait for that stage's event before the stage's
first kernel. The forward of block 0 so overlaps the update of block 1, and so on.

Same arithmetic, so the same parameters bit for bit: only the stream and the order of the
per-tensor kernels change. Stages: ``forward_stages(model)``. The fused LM loss reads the head's
weight without calling the head, so the head's update is awaited by the final norm, whose call
always comes right before the head's use.

The update's stream has the highest priority, since the chain of stage updates is the critical
path (each stage's forward waits for its update). Measured on an H200, the step is shorter than
with the update after the backward, by less than the update's own time: beside the forward the
update kernels run at about half their speed, whatever the streams' priorities or the update's
block size.

Nothing waits on the host. What reads parameters or optimizer state outside a forward (a
checkpoint, a state dict, a load) must ``settle_updates`` first: TritonAdamW's ``state_dict`` and
``load_state_dict`` do, and so does the training loop before evaluating, saving and loading.
Gradients freed by ``zero_grad`` after the step stay referenced here until the stage's forward
has waited for its update, and are released then, back to the step's stream: kept from reuse
while the update reads them, without ``record_stream``, which would hold their memory from the
next forward's activations and grow the reserved memory. On a CPU there is no
side stream: the stages update in place, in order, which is correct and saves nothing (tests
check the staging logic there).
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
from torch import nn


def forward_stages(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """[(the module whose forward starts the use, the parameters it uses)] in forward order, for
    optimus_core.model.transformer.Transformer: embedding, each block, final norm + LM head (a
    pipeline stage: those it has)."""
    stages = [(model.embed, list(model.embed.parameters()))] if model.embed is not None else []
    stages += [(block, list(block.parameters())) for block in model.blocks.values()]
    if model.final_norm is not None:
        stages.append((model.final_norm, list(model.final_norm.parameters()) + list(model.lm_head.parameters())))
    return stages


class UpdateBesideForward:
    priority = -1000  # the update's stream: the highest priority there is (a large negative is clamped to it)

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter]):
        """Stages of ``model`` covering ``params`` (the optimizer's); ValueError if one is missing."""
        params = [p for p in params]
        wanted = {id(p) for p in params}
        stages = [(module, [p for p in ps if id(p) in wanted]) for module, ps in forward_stages(model)]
        staged = {id(p) for _, ps in stages for p in ps}
        missing = [name for name, p in model.named_parameters() if id(p) in wanted and id(p) not in staged]
        if missing or len(staged) != len(wanted):
            raise ValueError(f"UpdateBesideForward: parameters outside every forward stage: {missing or '?'}; "
                             "their updates would not be awaited")
        self.stages = stages
        device = params[0].device if params else torch.device("cpu")
        self.backend = getattr(torch, device.type) if device.type in ("cuda", "xpu") else None
        self.device = device
        self.stream = self.backend.Stream(device=device, priority=self.priority) if self.backend else None
        self._pending: dict[int, object] = {}  # stage index -> its event, until a forward waits for it
        self._held: dict[int, list[torch.Tensor]] = {}  # stage index -> what its update reads
        tracker = weakref.ref(self)  # the hooks must not keep the updater (and its optimizer) alive
        for index, (module, _) in enumerate(stages):
            module.register_forward_pre_hook(_waiter(tracker, index))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def step(self, update: Callable[[list[nn.Parameter]], None], keep: Iterable[torch.Tensor | None] = (),
             gradients: Callable[[nn.Parameter], list[torch.Tensor]] | None = None) -> None:
        """Queue ``update(stage_params)`` for every stage, in order, on the side stream.

        ``keep``: tensors made on the current stream that the update reads (the clip factor):
        held until every stage's update has been waited for, as the gradients are.
        ``gradients(p)``: the tensors ``p``'s update reads as its gradient (default: ``p.grad``;
        the optimizer's own where they are elsewhere: bf16 copies), held per stage.
        """
        if gradients is None:
            gradients = _own_grad
        if self.stream is None:
            for _, params in self.stages:
                update(params)
            return
        main = self.backend.current_stream(self.device)
        self.stream.wait_stream(main)  # the gradients and the clip factor are complete there
        with self.backend.stream(self.stream):
            for index, (_, params) in enumerate(self.stages):
                update(params)
                event = self.backend.Event()
                event.record(self.stream)
                self._pending[index] = event
                # zero_grad drops the gradients next, while the update may still read them
                self._held[index] = [g for p in params for g in gradients(p)]
        self._held[len(self.stages) - 1] += [t for t in keep if t is not None]

    def wait_for(self, index: int) -> None:
        """The current stream waits for the update of stage ``index`` (and so of every stage
        before it: the side stream runs them in order)."""
        done = [i for i in self._pending if i <= index]
        if not done:
            return
        event = self._pending[max(done)]
        self.backend.current_stream(self.device).wait_event(event)
        for i in done:  # read by updates the current stream now waits for: reusable on it
            del self._pending[i]
            self._held.pop(i, None)

    def settle(self) -> None:
        """The current stream waits for every queued update: parameters and state are current."""
        if self._pending:
            self.backend.current_stream(self.device).wait_stream(self.stream)
            self._pending.clear()
            self._held.clear()


def _own_grad(p: nn.Parameter) -> list[torch.Tensor]:
    return [] if p.grad is None else [p.grad]


def _waiter(tracker: weakref.ref, index: int):
    def before_forward(module, args):
        updates = tracker()
        if updates is not None and updates._pending:
            updates.wait_for(index)
    return before_forward


def settle_updates(optimizer: torch.optim.Optimizer) -> None:
    """Wait for an update queued beside the forward, if ``optimizer`` has one (a no-op otherwise)."""
    updates = getattr(optimizer, "beside_forward", None)
    if updates is not None:
        updates.settle()
