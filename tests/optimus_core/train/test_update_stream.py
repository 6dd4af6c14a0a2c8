"""The update beside the forward (optimus_core.train.update_stream): its stages cover every
parameter once in the forward's order; each stage's forward waits for its own update (and so
for the earlier stages'); training with it gives the parameters, moments and losses of the plain
update bit for bit, on a CPU (no side stream) and on a GPU (a side stream, the gpu-marked test,
with gradient accumulation, evaluation and a state dict between steps, eager and compiled)."""
import dataclasses
import os

import pytest
import torch

from optimus_core.config import DataConfig, ExecutionConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig
from optimus_core.execution import compile_blocks, resolve_choices
from optimus_core.model.transformer import Transformer
from optimus_core.train.optim import build_optimizer
from optimus_core.train.step import train_step
from optimus_core.train.update_stream import UpdateBesideForward, forward_stages, settle_updates

MODEL = ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, max_seq_len=8, pad_vocab_to=64,
                    moe=MoEConfig(n_experts=4, top_k=2, d_expert=8))
TRITON_ON_CPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _model(device="cpu", cfg=MODEL):
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model.to(device)


def _batch(step, device="cpu", rows=4):
    return torch.randint(0, 64, (rows, 9), generator=torch.Generator().manual_seed(100 + step)).to(device)


def test_stages_cover_every_parameter_once_in_forward_order():
    model = _model()
    stages = forward_stages(model)
    assert [m for m, _ in stages] == [model.embed, *model.blocks.values(), model.final_norm]
    staged = [p for _, ps in stages for p in ps]
    assert len(staged) == len({id(p) for p in staged}) == len(list(model.parameters()))
    assert stages[-1][1][-1] is model.lm_head.weight  # the head's update is awaited at the final norm


def test_a_parameter_outside_every_stage_is_refused():
    model = _model()
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="outside every forward stage"):
        UpdateBesideForward(model, [*model.parameters(), stray])


class _Recorder:
    """A stand-in for torch.cuda: streams and events as names, waits recorded."""

    def __init__(self):
        self.waits = []

    def current_stream(self, device):
        return self

    def wait_event(self, event):
        self.waits.append(event)

    def wait_stream(self, stream):
        self.waits.append("all")


def test_each_stage_waits_for_its_own_update_and_never_twice():
    model = _model()
    updates = UpdateBesideForward(model, model.parameters())
    updates.backend = recorder = _Recorder()
    updates._pending = {i: f"event {i}" for i in range(len(updates.stages))}  # a step was queued
    updates._held = {i: [f"gradients of stage {i}"] for i in range(len(updates.stages))}
    model.blocks["1"](*_block_inputs(model))  # block 1 is stage 2: it waits for stage 2, so for 0 and 1
    assert recorder.waits == ["event 2"] and sorted(updates._pending) == [3, 4]
    assert sorted(updates._held) == [3, 4]  # what the waited updates read is released
    model.blocks["1"](*_block_inputs(model))  # its update is done: no second wait
    assert recorder.waits == ["event 2"]
    model(torch.zeros(1, 4, dtype=torch.long))  # a whole forward: the rest, each stage once
    assert recorder.waits == ["event 2", "event 3", "event 4"] and not updates.pending and not updates._held
    updates._pending, updates._held = {0: "event 0"}, {0: ["gradients"]}
    settle_updates(type("Opt", (), {"beside_forward": updates})())
    assert recorder.waits[-1] == "all" and not updates.pending and not updates._held


def _block_inputs(model):
    cos, sin = model.rope(4)
    return torch.zeros(1, 4, MODEL.d_model), cos, sin


def _train(model, opt, steps, device, dtype, *, between=None, micro_batch=0):
    losses = []
    for step in range(steps):
        stats = train_step(model, opt, _batch(step, device), micro_batch=micro_batch, grad_clip=0.05, lr=1e-2,
                           dtype=dtype)
        losses.append(stats.loss)
        if between is not None:
            between(step)
    settle_updates(opt)
    return losses


def _same_training(device, dtype, *, beside, compiled=False, micro_batch=0, between=None):
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    run = RunConfig(model=MODEL, optim=cfg, data=DataConfig(seq_len=8),
                    execution=ExecutionConfig(dtype=dtype, adamw="triton", experts="loop"))
    plan = resolve_choices(run, device)
    assert plan.adamw == "triton" and plan.update_beside_forward == (device == "cuda")
    plain, mine = _model(device), _model(device)
    if compiled:
        compile_blocks(plain)
        compile_blocks(mine)
    plain_opt = build_optimizer(plain, cfg, dataclasses.replace(plan, update_beside_forward=False))
    opt = build_optimizer(mine, cfg, plan)
    if beside and opt.beside_forward is None:  # a CPU: attached by hand (the plan has it on CUDA)
        opt.beside_forward = UpdateBesideForward(mine, mine.parameters())
    assert plain_opt.beside_forward is None and (opt.beside_forward is not None) == beside
    ref = _train(plain, plain_opt, 4, device, dtype, micro_batch=micro_batch)
    got = _train(mine, opt, 4, device, dtype, micro_batch=micro_batch,
                 between=between and (lambda step: between(mine, opt, step)))
    assert got == ref
    for (name, p), q in zip(mine.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(opt.state[p]["exp_avg_sq"], plain_opt.state[q]["exp_avg_sq"]), name


@TRITON_ON_CPU
def test_training_beside_the_forward_is_the_plain_training_on_a_cpu():
    _same_training("cpu", "float32", beside=True)


def _evaluate_and_snapshot(model, opt, step):
    """Between steps: an evaluation forward and a state dict (which settles first)."""
    with torch.no_grad():
        model.eval()
        model(_batch(50 + step, "cuda")[:, :-1])
    if step == 1:
        state = opt.state_dict()
        assert not opt.beside_forward.pending
        assert all(torch.isfinite(s["exp_avg"]).all() for s in state["state"].values())


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_training_beside_the_forward_on_a_side_stream(compiled):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _same_training("cuda", "bfloat16", beside=True, compiled=compiled, micro_batch=2,
                   between=_evaluate_and_snapshot)
