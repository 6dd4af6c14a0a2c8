"""The optimizers keep the experts' bf16 weight copies current (train.expert_weight_casts): after
every step of a bf16 run each copy equals its weight cast, bit for bit, with TritonAdamW (which
writes it in its update kernel) and torch's AdamW (a cast after its step), after a skipped step,
and across a checkpoint resume; and the run is the run without copies, bit for bit."""
import os

import pytest
import torch

import kernels
from optimus_core import presets
from optimus_core.config import ModelConfig, MoEConfig, OptimConfig
from optimus_core.model.experts import assert_weight_casts_current
from optimus_core.model.transformer import Transformer
from optimus_core.train import checkpoint as ckpt
from optimus_core.train import loop as loop_module
from optimus_core.train import step as step_module
from optimus_core.train.loop import Trainer
from optimus_core.train.optim import build_optimizer
from optimus_core.train.step import train_step

from sinks import ListSink

MODEL = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, pad_vocab_to=64,
                    moe=MoEConfig(n_experts=4, top_k=2, d_expert=8))
STEPS = 5
TRITON_ON_CPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _model(casts: bool):
    model = Transformer(MODEL)
    model.init_weights(torch.Generator().manual_seed(0))
    if casts:
        model.set_expert_weight_casts(torch.bfloat16)
    return model


def _batch(step):
    return torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(100 + step))


def _step(model, opt, step, **kw):
    return train_step(model, opt, _batch(step), micro_batch=0, grad_clip=0.05, lr=1e-2, dtype="bfloat16", **kw)


@pytest.mark.parametrize("implementation", ["torch", pytest.param("triton", marks=TRITON_ON_CPU)])
def test_every_step_keeps_the_copies_current_and_the_run_unchanged(implementation, monkeypatch):
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, implementation=implementation)
    fused = []
    real = kernels.adamw_step_

    def spy(*args, param_bf16_N=None, **kw):
        fused.append(param_bf16_N is not None)
        return real(*args, param_bf16_N=param_bf16_N, **kw)

    monkeypatch.setattr(kernels, "adamw_step_", spy)
    plain, copied = _model(casts=False), _model(casts=True)
    plain_opt, opt = build_optimizer(plain, cfg), build_optimizer(copied, cfg)
    assert type(opt).__name__ == ("TritonAdamW" if implementation == "triton" else "AdamW")
    for step in range(STEPS):
        a, b = _step(plain, plain_opt, step), _step(copied, opt, step)
        assert a.loss == b.loss and float(a.grad_norm) == float(b.grad_norm)
        assert assert_weight_casts_current(copied) == 4
    for (name, p), q in zip(plain.named_parameters(), copied.parameters()):
        assert torch.equal(p, q), name
    if implementation == "triton":  # the 4 expert weights were written by the update kernel itself
        per_step = len(fused) // (2 * STEPS)
        assert sum(fused) == 4 * STEPS and per_step == len(list(copied.parameters()))


def test_a_skipped_step_writes_nothing():
    model = _model(casts=True)
    opt = build_optimizer(model, OptimConfig(lr=1e-2, implementation="torch"))
    _step(model, opt, 0)
    before = {n: t.clone() for n, t in model.named_buffers() if n.endswith("_cast")}
    stats = _step(model, opt, 1, accept=lambda loss: False)
    assert stats.skipped
    for name, t in model.named_buffers():
        if name.endswith("_cast"):
            assert torch.equal(t, before[name]), name
    assert assert_weight_casts_current(model) == 4


def test_a_resumed_bf16_run_with_a_skipped_step_is_the_same_run(tokens_dir, tmp_path, monkeypatch):
    """Trainer end to end with the copies: a NaN loss skipped, a kill after the step-3 checkpoint,
    a resume (the checkpoint loads over freshly initialised weights and copies): the losses of
    the uninterrupted run, bit for bit, and current copies at the end."""
    cfg = presets.get("mula-7b-a1b@laptop").run_config(**{
        "train.steps": 6, "train.checkpoint_every": 3, "train.eval_batches": 1, "train.device": "cpu",
        "train.dtype": "bfloat16", "schedule.warmup_steps": 2, "model.n_layers": 1})
    real_build = loop_module.build_model

    def build_with_copies(cfg, device="cpu"):  # what the loop's build_model does with the flag on
        model = real_build(cfg, device)
        assert model.use_expert_weight_casts(cfg.train)
        return model

    monkeypatch.setattr(loop_module, "build_model", build_with_copies)
    real_loss, calls = step_module.micro_batch_loss, [0]

    def nan_on_call_2(*args, **kwargs):
        calls[0] += 1
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if calls[0] == 2 else loss

    monkeypatch.setattr(step_module, "micro_batch_loss", nan_on_call_2)
    straight = ListSink()
    trainer = Trainer(cfg, tokens_dir, tmp_path / "straight", writer=straight, progress=False)
    trainer.fit()
    assert [e["kind"] for e in trainer.events] == ["nonfinite"]
    assert assert_weight_casts_current(trainer.model) == 2

    calls[0] = 0
    real_step, steps = loop_module.train_step, [0]

    def dies_at_call_6(*args, **kwargs):
        steps[0] += 1
        if steps[0] == 6:
            raise KeyboardInterrupt("simulated kill")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", dies_at_call_6)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, tokens_dir, tmp_path / "resumed", writer=ListSink(), progress=False).fit()
    monkeypatch.setattr(loop_module, "train_step", real_step)
    assert ckpt.latest_valid(tmp_path / "resumed").step == 3
    resumed = ListSink()
    trainer = Trainer(cfg, tokens_dir, tmp_path / "resumed", writer=resumed, progress=False)
    assert trainer.resumed_from == 3 and assert_weight_casts_current(trainer.model) == 2
    trainer.fit()
    assert resumed.losses() == straight.losses()[3:]
    assert assert_weight_casts_current(trainer.model) == 2
