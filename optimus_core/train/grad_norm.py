"""The gradient norm for clipping, computed under the backward instead of after it.

    norms = GradNormUnderBackward(params)      # once: hooks on every parameter
    norms.arm()                                # before the last micro-batch's backward
    loss.backward()                            # each finished gradient's norm starts on a side stream
    total_norm = norms.total()                 # 0-d float32 on the device, no host sync

Clipping needs the L2 norm of all gradients before the update, and computing it after the
backward is one more read of every gradient (14 GB a step for the 8-layer mula-7b-a1b), with the
device doing nothing else. Here a post-accumulate-grad hook queues each gradient's squared
norm on a side stream as soon as the last backward has finished it, so the reductions run beside
the backward's remaining GEMMs (which leave memory bandwidth to spare) and only the last few are
left at the end. Gradients of earlier micro-batches are not final, hence ``arm()`` before the
last backward only (train_step does it).

Some kernels can do better than a read beside the backward: the triton experts' dW kernel sums
the squares of the gradient as it stores it (optimus_kernels.grouped_mm's ``dw_square``: a 0-d tensor
whose gradient is that sum). ``norms.take_squares_from({param: dw_square})`` uses those sums for
the parameters whose gradient the last backward makes whole (no gradient before ``arm()``, so no
earlier micro-batch to add); the others are read as above.

The value is the same as torch.nn.utils.get_total_norm's up to float32 rounding: per-gradient
norms, squared, summed, square root. A gradient the hooks did not see (set by hand, a skipped
hook) is added at ``total()`` on the main stream. On a CPU there is no side stream: the hooks
compute each norm in place, which is correct but saves nothing (train.optim uses it on GPUs).
"""
from __future__ import annotations

import weakref

import torch


class GradNormUnderBackward:
    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.armed = False
        self._squares: dict[int, torch.Tensor] = {}  # id(param) -> its gradient's squared norm
        self._from_kernel: set[int] = set()  # id(param) of those with a dw_square (take_squares_from)
        self._whole: set[int] = set()  # id(param) of those without a gradient when armed
        self._streams: dict[torch.device, object] = {}
        # The hooks hold the tracker weakly: a strong reference would make a cycle (parameter ->
        # hook -> tracker -> parameter) that keeps a dropped model's weights alive until the
        # cycle collector runs (one benchmark variant's weights left in the next one's memory).
        tracker = weakref.ref(self)

        def on_grad(p):
            alive = tracker()
            if alive is not None:
                alive._on_grad(p)

        for p in self.params:
            p.register_post_accumulate_grad_hook(on_grad)

    def take_squares_from(self, squares: dict[torch.Tensor, torch.Tensor]) -> None:
        """{param: its dw_square}: each backward leaves the sum of the squares of ``param``'s
        new gradient as ``dw_square``'s gradient (made by the kernel that made the gradient);
        it stands for a read of the gradient where that gradient is the new one whole."""
        tracker = weakref.ref(self)
        for p, square in squares.items():
            if not any(p is q for q in self.params):
                raise ValueError("take_squares_from: a parameter this tracker does not cover")
            self._from_kernel.add(id(p))

            def on_square(square, key=id(p)):
                alive = tracker()
                if alive is not None:
                    alive._on_square(key, square)

            square.register_post_accumulate_grad_hook(on_square)

    def arm(self) -> None:
        """The next backward is the last of the step: record its gradients' norms."""
        self._squares.clear()
        self._whole = {id(p) for p in self.params if p.grad is None and id(p) in self._from_kernel}
        self.armed = True

    def disarm(self) -> None:
        self.armed = False
        self._squares.clear()
        self._whole.clear()

    def _side_stream(self, device: torch.device):
        if device.type not in ("cuda", "xpu"):
            return None
        if device not in self._streams:
            self._streams[device] = getattr(torch, device.type).Stream(device=device)
        return self._streams[device]

    def _on_square(self, key: int, square: torch.Tensor) -> None:
        sum_of_squares, square.grad = square.grad, None  # every backward's: none accumulates
        if self.armed and key in self._whole and sum_of_squares is not None:
            self._squares[key] = sum_of_squares

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed or p.grad is None or id(p) in self._whole:  # (its square comes from the kernel)
            return
        grad = p.grad
        side = self._side_stream(grad.device)
        if side is None:
            self._squares[id(p)] = _square_norm(grad)
            return
        backend = getattr(torch, grad.device.type)
        side.wait_stream(backend.current_stream(grad.device))  # the gradient is complete there
        with backend.stream(side):
            self._squares[id(p)] = _square_norm(grad)
        grad.record_stream(side)  # its memory is not reused before the side stream has read it

    def total(self) -> torch.Tensor:
        """The global L2 norm of the parameters' gradients (0-d float32, on their device); disarms."""
        grads = [p for p in self.params if p.grad is not None]
        if not grads:
            raise ValueError("GradNormUnderBackward.total: no parameter has a gradient")
        device = grads[0].grad.device
        side = self._streams.get(device)
        squares = [self._squares.get(id(p)) for p in grads]
        if side is not None:
            main = getattr(torch, device.type).current_stream(device)
            main.wait_stream(side)
            for s in squares:  # made on the side stream, read here: keep them until then
                if s is not None:
                    s.record_stream(main)
        squares = [s if s is not None else _square_norm(p.grad) for s, p in zip(squares, grads)]
        self.disarm()
        return torch.stack(squares).sum().sqrt()


def _square_norm(grad: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(grad, dtype=torch.float32).square()
