"""The training loop: it learns, accumulation is exact, and a resumed run is the same run."""
import json
import shutil

import pytest
import torch

from optimus_core import load_model, presets
from optimus_core.config import (ConfigError, DataConfig, ExecutionConfig, ModelConfig, MoEConfig, RunConfig,
                                 TrainConfig)
from optimus_core.train import checkpoint as ckpt
from optimus_core.train import loop as loop_module
from optimus_core.train.build import build_model
from optimus_core.train.loop import Trainer
from optimus_core.train.optim import build_optimizer
from optimus_core.train.step import train_step
from sinks import ListSink


def laptop(name, **overrides):
    base = {"train.steps": 40, "train.eval_batches": 2, "train.device": "cpu", "schedule.warmup_steps": 5}
    return presets.get(name).run_config(**{**base, **overrides})


@pytest.mark.parametrize("preset", ["mula-1b@laptop", "mula-7b-a1b@laptop"])
def test_loss_falls(tokens_dir, tmp_path, preset):
    sink = ListSink()
    summary = Trainer(laptop(preset), tokens_dir, tmp_path / "run", writer=sink, progress=False).fit()
    losses = sink.column("train", "loss")
    assert len(losses) == 40 and summary.steps == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    evals = sink.column("eval", "loss")
    assert len(evals) == 2 and evals[-1] < evals[0]  # step 0 and the end
    assert set(sink.rows["eval"][-1]) >= {"loss.code", "loss.prose", "loss.docs", "ppl.code", "bpb.prose"}
    if "7b" in preset:
        row = sink.rows["train"][-1]
        assert row["expert_load"].shape == (4, 16) and abs(row["expert_load"].sum() - 4) < 1e-5
        assert row["moe_imbalance"] >= 1.0 and row["lb_loss"] > 0


def test_gradient_accumulation_matches_one_large_batch():
    cfg = RunConfig(model=ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16),
                    train=TrainConfig(global_batch=8), data=DataConfig(seq_len=16))
    batch = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    params = []
    for micro in (0, 2):
        model = build_model(cfg)
        opt = build_optimizer(model, cfg.optim)
        train_step(model, opt, batch, micro_batch=micro, grad_clip=1.0, lr=1e-3, dtype="float32")
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-6)


def test_a_padded_vocabulary_trains_with_the_fused_lm_loss(tokens_dir, tmp_path):
    """The LM loss is always fused with the head (the logits path is gone as a choice:
    train.fused_lm_loss is an error naming why); a padded vocabulary trains through it."""
    cfg = laptop("mula-7b-a1b@laptop", **{"train.steps": 6, "model.n_layers": 1, "train.eval_batches": 1,
                                          "model.vocab_size": 4100})
    assert cfg.model.padded_vocab_size > cfg.model.vocab_size
    sink = ListSink()
    trainer = Trainer(cfg, tokens_dir, tmp_path / "run", writer=sink, progress=False)
    assert trainer.plan.lm_loss == "torch"  # auto on a CPU: the fused loss's torch softmax
    trainer.fit()
    curve = sink.column("train", "loss")
    assert len(curve) == 6 and curve[-1] < curve[0]
    with pytest.raises(ConfigError, match=r"train\.fused_lm_loss is no longer a choice"):
        laptop("mula-7b-a1b@laptop", **{"train.fused_lm_loss": False})


def test_interrupted_run_resumes_bit_identically(tokens_dir, tmp_path, monkeypatch):
    cfg = laptop("mula-7b-a1b@laptop", **{"train.steps": 8, "train.checkpoint_every": 3})
    straight = ListSink()
    Trainer(cfg, tokens_dir, tmp_path / "straight", writer=straight, progress=False).fit()

    real_step, calls = loop_module.train_step, []

    def dies_at_step_5(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt("simulated kill")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", dies_at_step_5)
    first = ListSink()
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, tokens_dir, tmp_path / "resumed", writer=first, progress=False).fit()
    monkeypatch.setattr(loop_module, "train_step", real_step)
    assert ckpt.latest_valid(tmp_path / "resumed").step == 3

    second = ListSink()
    trainer = Trainer(cfg, tokens_dir, tmp_path / "resumed", writer=second, progress=False)
    assert trainer.resumed_from == 3
    trainer.fit()
    assert second.losses() == straight.losses()[3:]  # bit for bit, steps 4..8
    assert first.losses() == straight.losses()[:4]


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tokens_dir, tmp_path):
    cfg = laptop("mula-1b@laptop", **{"train.steps": 4, "train.checkpoint_every": 2, "train.keep_checkpoints": 3})
    Trainer(cfg, tokens_dir, tmp_path / "run", progress=False).fit()
    newest = ckpt.latest_valid(tmp_path / "run")
    assert newest.step == 4
    with open(next(newest.path.glob("*.distcp")), "r+b") as f:
        f.seek(100)
        f.write(b"garbage")
    with pytest.warns(UserWarning, match="fails its sha256"):
        assert ckpt.latest_valid(tmp_path / "run").step == 2
    shutil.rmtree(ckpt.checkpoints_dir(tmp_path / "run") / "step_000002" / "meta.json", ignore_errors=True)
    (ckpt.checkpoints_dir(tmp_path / "run") / "step_000002" / "meta.json").unlink()
    with pytest.warns(UserWarning):
        assert ckpt.latest_valid(tmp_path / "run") is None


def test_load_model_returns_the_trained_weights(tokens_dir, tmp_path):
    cfg = laptop("mula-7b-a1b@laptop", **{"train.steps": 2})
    trainer = Trainer(cfg, tokens_dir, tmp_path / "run", progress=False)
    trainer.fit()
    model, loaded_cfg = load_model(tmp_path / "run")
    assert loaded_cfg == cfg
    meta = ckpt.latest_valid(tmp_path / "run").meta  # how it executed, beside what it trained
    assert meta["execution_plan"] == trainer.plan.to_dict()
    assert (meta["execution_plan"]["dtype"], meta["execution_plan"]["experts"]) == ("float32", "loop")
    for (name, a), b in zip(trainer.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_resuming_with_another_model_is_refused(tokens_dir, tmp_path):
    Trainer(laptop("mula-1b@laptop", **{"train.steps": 1}), tokens_dir, tmp_path / "run", progress=False).fit()
    with pytest.raises(ValueError, match="different model configuration"):
        Trainer(laptop("mula-7b-a1b@laptop", **{"train.steps": 2}), tokens_dir, tmp_path / "run", progress=False)


def test_a_checkpoint_of_an_earlier_optimus_is_refused_naming_the_field(tokens_dir, tmp_path):
    """A checkpoint whose config holds a choice at its former place (train.dtype) is not resumed as
    if it were today's: the resume is refused in one line naming the field; nothing is moved."""
    cfg = laptop("mula-7b-a1b@laptop", **{"train.steps": 2, "train.checkpoint_every": 1})
    Trainer(cfg, tokens_dir, tmp_path / "run", progress=False).fit()
    meta_path = ckpt.latest_valid(tmp_path / "run").path / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["train"]["dtype"] = meta["config"]["execution"].pop("dtype")
    meta_path.write_text(json.dumps(meta))
    longer = laptop("mula-7b-a1b@laptop", **{"train.steps": 3})
    with pytest.raises(ConfigError, match=r"^train.dtype: a field of an earlier Optimus's config, which is "
                                          r"execution.dtype now"):
        Trainer(longer, tokens_dir, tmp_path / "run", progress=False)
    assert [p.name for p in ckpt.list_step_dirs(tmp_path / "run")] == ["step_000001", "step_000002"]


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_and_keep_parameter_names():
    """execution.compile compiles each block in place (~40 s on 2 CPU cores, hence slow)."""
    losses, names = [], []
    for compile_ in (False, True):
        cfg = RunConfig(model=ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16,
                                          moe=MoEConfig(n_experts=4, top_k=2, d_expert=16)),
                        train=TrainConfig(global_batch=4), data=DataConfig(seq_len=16),
                        execution=ExecutionConfig(compile=compile_))
        model = build_model(cfg)
        opt = build_optimizer(model, cfg.optim)
        batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
        losses.append([train_step(model, opt, batch, micro_batch=0, grad_clip=1.0, lr=1e-2, dtype="float32").loss
                       for _ in range(3)])
        names.append(list(model.state_dict()))
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert names[0] == names[1]


def test_checkpoints_by_wall_time_as_well_as_steps(tokens_dir, tmp_path, monkeypatch):
    # A fake clock: each step takes 4 "minutes"; checkpoint_every_minutes = 10 saves after every
    # third step of the job, beside the step cadence (every 5), and keep_checkpoints keeps them all.
    clock = [0.0]

    def tick():
        return clock[0]

    monkeypatch.setattr(loop_module.time, "monotonic", tick)
    real_step = loop_module.train_step

    def slow_step(*a, **k):
        clock[0] += 240.0
        return real_step(*a, **k)

    monkeypatch.setattr(loop_module, "train_step", slow_step)
    cfg = laptop("mula-1b@laptop", **{"train.steps": 10, "train.checkpoint_every": 5,
                                      "train.checkpoint_every_minutes": 10, "train.keep_checkpoints": 10})
    Trainer(cfg, tokens_dir, tmp_path / "run", progress=False).fit()
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == [3, 5, 8, 10], saved  # 12 min at 3; 5 by steps (the clock restarts); 8 = 5 + 3; the end
