"""Export to / import from Hugging Face transformers: the HF model computes our logits exactly.

Tiny runs (2 steps) of the laptop MoE and dense presets are trained with the real `optimus
pretrain`, exported with `optimus export-hf`, loaded with AutoModelForCausalLM, and compared on
random tokens in float32 (1e-4: both compute the same ops in float32; only summation order and
attention kernels differ, ~1e-6 observed).
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from optimus_core import load_model  # noqa: E402
from optimus_core.hf import ExportError, export_hf, hf_architecture, import_hf  # noqa: E402
from workflow.cli import main  # noqa: E402

PRESETS = {"moe": "mula-7b-a1b@laptop", "dense": "mula-1b@laptop"}


@pytest.fixture(scope="module", params=sorted(PRESETS))
def trained(request, tmp_path_factory, tokens_dir):
    """(kind, run_dir, hf_dir): a 2-step run of the preset and its export via the CLI."""
    root = tmp_path_factory.mktemp(request.param)
    run_dir, hf_dir = root / "run", root / "hf"
    code = main(["pretrain", "--preset", PRESETS[request.param], "--data", str(tokens_dir), "--out", str(run_dir),
                 "--steps", "2", "--quiet", "--set", "train.eval_batches=1"])
    assert code == 0
    assert main(["export-hf", "--run", str(run_dir), "--out", str(hf_dir)]) == 0
    return request.param, run_dir, hf_dir


def test_transformers_logits_match_ours(trained):
    kind, run_dir, hf_dir = trained
    ours, cfg = load_model(run_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert hf.dtype == torch.float32  # config.json says float32: the dtype our checkpoints hold
    # mula-1b is OLMo-1B (non-parametric LayerNorm, no QK-norm): OlmoForCausalLM, exactly
    assert type(hf).__name__ == {"moe": "OlmoeForCausalLM", "dense": "OlmoForCausalLM"}[kind]
    assert hf.config.vocab_size == cfg.model.padded_vocab_size
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(tokens), hf(tokens).logits
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


def test_tokenizer_loads_with_special_tokens(trained, tokens_dir):
    _, _, hf_dir = trained
    manifest = json.loads((tokens_dir / "manifest.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|padding|>"
    assert tok.eos_token_id == manifest["eos_id"] and tok.pad_token_id == manifest["pad_id"]
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(str(tokens_dir / "tokenizer.json"))
    text = "def f(x):\n    return x + 1  # the corpus mixes prose and code"
    assert tok(text)["input_ids"] == ref.encode(text).ids
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["eos_token_id"] == manifest["eos_id"] and config["tie_word_embeddings"] is False


def test_the_weights_are_as_readable_as_the_other_files(trained):
    """safetensors writes through a private (0600) temporary file; the export's weights are no
    more private than its config (the umask decides, as for any file the user writes)."""
    _, _, hf_dir = trained
    modes = {p.name: p.stat().st_mode & 0o777 for p in hf_dir.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"] == modes["tokenizer.json"], modes


def test_round_trip_import_gives_identical_weights(trained):
    _, run_dir, hf_dir = trained
    ours, cfg = load_model(run_dir)
    back, back_cfg = import_hf(hf_dir)
    assert back_cfg == cfg.model
    want, got = ours.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_import_of_a_transformers_saved_directory(trained, tmp_path):
    """A directory written by transformers itself (no optimus.json; transformers 5 saves experts
    fused as gate_up_proj) imports to the same model."""
    import shutil
    _, run_dir, hf_dir = trained
    plain = tmp_path / "plain"
    transformers.AutoModelForCausalLM.from_pretrained(hf_dir).save_pretrained(plain)
    shutil.copyfile(hf_dir / "tokenizer.json", plain / "tokenizer.json")
    assert not (plain / "optimus.json").exists()
    ours, cfg = load_model(run_dir)
    back, back_cfg = import_hf(plain)
    assert back_cfg.padded_vocab_size == cfg.model.padded_vocab_size and back_cfg.moe == cfg.model.moe
    assert back_cfg.vocab_size == cfg.model.vocab_size  # recovered from tokenizer.json
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(tokens), back(tokens))


def test_bad_inputs_give_clear_errors(trained, tmp_path, capsys):
    kind, run_dir, _ = trained
    _, cfg = load_model(run_dir)
    with pytest.raises(ExportError, match="not a run directory"):
        export_hf(tmp_path, tmp_path / "out")
    with pytest.raises(ExportError, match="LlamaForCausalLM" if kind == "moe" else "only arch='olmo'"):
        export_hf(run_dir, tmp_path / "out", arch="llama")
    with pytest.raises(ExportError, match="arch = 'gpt2': unknown"):
        hf_architecture(cfg.model, "gpt2")
    (tmp_path / "no-tokenizer").mkdir()
    with pytest.raises(ExportError, match="tokenizer.json: missing"):
        export_hf(run_dir, tmp_path / "out", data_dir=tmp_path / "no-tokenizer")
    assert not (tmp_path / "out").exists()  # nothing half-written
    with pytest.raises(ExportError, match="not a Hugging Face model directory"):
        import_hf(tmp_path)
    assert main(["export-hf", "--run", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "not a run directory" in capsys.readouterr().err


def test_olmo_1b_maps_to_olmo_exactly():
    """mula-1b's architecture (OLMo-1B: non-parametric LayerNorm, no QK-norm, untied) is
    transformers' OlmoForCausalLM, logits and weights both ways."""
    from optimus_core.config import ModelConfig
    from optimus_core.hf import from_hf_config, from_hf_state, to_hf_config, to_hf_state
    from optimus_core.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, d_ff=96, qk_norm=False, max_seq_len=32,
                      norm="nonparametric_layernorm", pad_token_id=1)
    assert hf_architecture(cfg) == "olmo"
    with pytest.raises(ExportError, match="only arch='olmo'"):
        hf_architecture(cfg, "llama")
    ours = Transformer(cfg)
    ours.init_weights(seed=0)
    config = to_hf_config(cfg, "olmo", pad_id=1)
    hf_cfg = transformers.OlmoConfig(**{k: v for k, v in config.items()
                                        if k not in ("architectures", "model_type", "torch_dtype")})
    hf = transformers.OlmoForCausalLM(hf_cfg).eval()
    hf.load_state_dict(to_hf_state(cfg, ours.state_dict(), "olmo"))
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours.eval()(tokens)).abs().max().item() < 1e-4
    assert from_hf_config(config, vocab_size=300) == cfg
    back = from_hf_state(cfg, to_hf_state(cfg, ours.state_dict(), "olmo"), "olmo")
    assert all(torch.equal(v, back[k]) for k, v in ours.state_dict().items())
    with pytest.raises(ExportError, match="OlmoForCausalLM is dense without QK-norm"):
        hf_architecture(cfg.replace(qk_norm=True))


def test_dense_without_qk_norm_maps_to_llama_exactly():
    from optimus_core.config import ModelConfig
    from optimus_core.hf import to_hf_config, to_hf_state, from_hf_state
    from optimus_core.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, qk_norm=False,
                      max_seq_len=32)
    assert hf_architecture(cfg) == "llama"
    with pytest.raises(ExportError, match="always applies it"):
        hf_architecture(cfg, "olmoe")
    ours = Transformer(cfg)
    ours.init_weights(seed=0)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in to_hf_config(cfg, "llama").items()
                                         if k not in ("architectures", "model_type", "torch_dtype")})
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict(to_hf_state(cfg, ours.state_dict(), "llama"))
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours.eval()(tokens)).abs().max().item() < 1e-4
    back = from_hf_state(cfg, to_hf_state(cfg, ours.state_dict(), "llama"), "llama")
    assert all(torch.equal(v, back[k]) for k, v in ours.state_dict().items())


def test_fused_expert_layout_imports_like_the_per_expert_one():
    """transformers 5 holds experts fused (gate_up_proj (E, 2F, D), down_proj (E, D, F)); a
    checkpoint in that layout converts to the same weights as the per-expert one."""
    from optimus_core.config import ModelConfig, MoEConfig
    from optimus_core.hf import from_hf_state, to_hf_state
    from optimus_core.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=200, d_model=32, n_layers=1, n_heads=2, max_seq_len=16,
                      moe=MoEConfig(n_experts=4, top_k=2, d_expert=24))
    model = Transformer(cfg)
    model.init_weights(seed=0)
    per_expert = to_hf_state(cfg, model.state_dict(), "olmoe")
    fused = {k: v for k, v in per_expert.items() if ".experts." not in k}
    p = "model.layers.0.mlp.experts."
    fused[p + "gate_up_proj"] = torch.stack([torch.cat([per_expert[f"{p}{e}.gate_proj.weight"],
                                                        per_expert[f"{p}{e}.up_proj.weight"]]) for e in range(4)])
    fused[p + "down_proj"] = torch.stack([per_expert[f"{p}{e}.down_proj.weight"] for e in range(4)])
    a, b = from_hf_state(cfg, per_expert, "olmoe"), from_hf_state(cfg, fused, "olmoe")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], v) for k, v in model.state_dict().items())


def test_the_load_balancing_loss_is_transformers_own(trained):
    """The paper's load-balancing loss (model.moe.lb_loss_form = "all_layers") is transformers'
    OLMoE loss over every layer's router logits: the export's router_aux_loss_coef is our
    lb_loss_coef and the weighted terms agree. Our per-layer form agrees with transformers' loss
    of one layer's logits at lb_loss_coef / k, which the export then writes."""
    kind, run_dir, hf_dir = trained
    if kind != "moe":
        pytest.skip("a dense model has no router")
    from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

    from optimus_core.hf import to_hf_config

    ours, cfg = load_model(run_dir)
    moe = cfg.model.moe
    assert moe.lb_loss_form == "all_layers"
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert hf.config.router_aux_loss_coef == moe.lb_loss_coef
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours(tokens)
        router_logits = hf(tokens, output_router_logits=True).router_logits
    layers = ours.moe_layers()
    assert len(router_logits) == len(layers) > 1
    theirs = load_balancing_loss_func(tuple(router_logits), moe.n_experts, moe.top_k)
    torch.testing.assert_close(moe.lb_loss_coef * ours.lb_loss().float(),
                               hf.config.router_aux_loss_coef * theirs.float(), rtol=1e-4, atol=1e-7)
    per_layer = cfg.model.replace(moe=moe.replace(lb_loss_form="per_layer"))
    coef = to_hf_config(per_layer, "olmoe")["router_aux_loss_coef"]
    assert coef == pytest.approx(moe.lb_loss_coef / moe.top_k)
    ours.cfg = per_layer
    for i, logits in enumerate(router_logits):  # one layer: the two conventions coincide
        share = ours.routing_shares()[i:i + 1]
        probs = ours.moe_layers()[i].last_mean_probs_E[None]
        mine = moe.n_experts * (share * probs).sum()
        torch.testing.assert_close(moe.lb_loss_coef * mine.float(),
                                   coef * load_balancing_loss_func((logits,), moe.n_experts, moe.top_k).float(),
                                   rtol=1e-4, atol=1e-7)
