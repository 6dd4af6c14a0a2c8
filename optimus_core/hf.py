"""Hugging Face ``transformers`` export and import of Mula models (no transformers import needed).

    from optimus_core.hf import export_hf, import_hf
    export_hf("results/runs/laptop-mula-7b-a1b", "results/hf/mula-7b-a1b")   # a directory that
    # transformers.AutoModelForCausalLM.from_pretrained(...) and AutoTokenizer load
    model, model_cfg = import_hf("results/hf/mula-7b-a1b")                   # and back

Which Hugging Face architecture (``hf_architecture``):

- MoE presets -> ``OlmoeForCausalLM``. Checked against transformers' Olmoe code: pre-norm
  RMSNorm (float32 statistics), QK-norm over the whole q / k projection before the head split
  (q_norm dim = d_model, k_norm dim = kv_heads * head_dim), rotate-half RoPE, router
  softmax(float32) -> top-k -> optional renormalisation (``norm_topk_prob``), experts
  down(silu(gate(x)) * up(x)), untied lm_head. Our ``w_up`` (E * D, 2F) rows, seen as (E, D,
  2F) = [gate | up], becomes ``experts.{e}.gate_proj.weight`` (F, D) and ``up_proj`` (F, D);
  ``w_down`` (E * F, D), seen as (E, F, D), becomes
  ``down_proj.weight`` (D, F): the per-expert layout of the released OLMoE checkpoints, which
  transformers 4.x loads as is and 5.x fuses on load.
- Dense presets with QK-norm (all Mula presets) -> ``OlmoeForCausalLM`` with one expert and
  top-1. That is *exactly* our dense block: the router's softmax over a single logit is
  exp(0) = 1.0 in any dtype, so the one expert's SwiGLU output passes through unscaled. None of
  the dense HF architectures is exact: Llama and OLMo-1 have no QK-norm, OLMo-2 normalises
  after attention / MLP (post-norm), Qwen3 normalises q / k per head, not over the projection.
- Dense presets without QK-norm -> ``LlamaForCausalLM`` (pre-norm, rotate-half RoPE, SwiGLU,
  repeat-interleaved GQA): exact.
- Dense presets with OLMo-1B's non-parametric LayerNorm and no QK-norm (mula-1b) ->
  ``OlmoForCausalLM`` (LayerNorm without weight or bias at eps 1e-5 in float32, rotate-half RoPE,
  SwiGLU, no ``clip_qkv``): exact. An MoE or a QK-norm with that norm has no HF architecture.

transformers' OLMoE load-balancing loss is the paper's (``model.moe.lb_loss_form =
"all_layers"``): its ``router_aux_loss_coef`` is then our ``lb_loss_coef``. Our per-layer form is
1/k of it at balance, so its coefficient is exported as ``lb_loss_coef / k``, the nearest
transformers' loss comes (tests/stages/test_export.py compares both).

Not representable (``ExportError``): an MoE without QK-norm, a non-zero aux-loss-free balancing
bias (it changes expert selection; HF routers have none). A capacity factor is dropped with a
warning: HF models are dropless, which is what our model computes whenever no expert overflows.
The padded vocabulary is exported as is (``vocab_size`` = padded size), as OLMoE does (50304).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Optional, Union

import torch

from .atomic import atomic_dir
from .outputs import check_output, mark_output
from .config import ConfigError, ModelConfig, MoEConfig, from_dict

__all__ = ["ExportError", "hf_architecture", "to_hf_config", "to_hf_state", "from_hf_config",
           "from_hf_state", "export_hf", "import_hf", "ARCHITECTURES"]

ARCHITECTURES = ("olmoe", "llama", "olmo")
OPTIMUS_META = "optimus.json"  # our own ModelConfig, so an import recovers the exact config
_CLASS = {"olmoe": "OlmoeForCausalLM", "llama": "LlamaForCausalLM", "olmo": "OlmoForCausalLM"}
LAYERNORM = "nonparametric_layernorm"  # OLMo-1B's norm: the only one "olmo" has


class ExportError(ValueError):
    """The model, run or HF directory cannot be converted; the message says why and what to do."""


def _safetensors():
    """safetensors.torch, or ExportError in one line saying how to install it (the eval extra)."""
    try:
        import safetensors.torch
    except ImportError as e:
        raise ExportError(f"Hugging Face weights are read and written with the safetensors package, which is not "
                          f"installed here ({e}): install the eval extra, pip install -e '.[eval]'") from None
    return safetensors.torch


class ArchitectureError(ExportError, ConfigError):
    """The architecture asked for (``arch``) cannot hold the model: a choice to change (exit 2)."""


# ----------------------------------------------------------------------------- architecture

def hf_architecture(cfg: ModelConfig, arch: Optional[str] = None) -> str:
    """The exact HF architecture for ``cfg`` ("olmoe", "llama" or "olmo"); ``arch`` forces one, checked."""
    if arch is not None and arch not in ARCHITECTURES:
        raise ArchitectureError(f"arch = {arch!r}: unknown; known: {', '.join(ARCHITECTURES)}")
    if cfg.norm == LAYERNORM:
        if cfg.is_moe or cfg.qk_norm:
            raise ExportError(f"model.norm = {LAYERNORM!r} with {'model.moe set' if cfg.is_moe else 'QK-norm'}: "
                              "OlmoForCausalLM is dense without QK-norm and no other HF architecture has this "
                              "norm; cannot export exactly")
        if arch not in (None, "olmo"):
            raise ArchitectureError(f"arch = {arch!r}: the model's norm is OLMo-1B's non-parametric LayerNorm "
                                    "(model.norm); only arch='olmo' has it")
        return "olmo"
    exact = "olmoe" if (cfg.is_moe or cfg.qk_norm) else "llama"
    if arch is None:
        if cfg.is_moe and not cfg.qk_norm:
            raise ExportError("model.qk_norm = False with model.moe set: OlmoeForCausalLM always applies "
                              "QK-norm and no other HF MoE architecture matches; cannot export exactly")
        return exact
    if arch == "olmo":
        raise ArchitectureError("arch = 'olmo': OlmoForCausalLM's norm is a non-parametric LayerNorm and this "
                                f"model's is RMSNorm (model.norm = {cfg.norm!r}); use arch={exact!r}")
    if arch == "llama" and cfg.is_moe:
        raise ArchitectureError("arch = 'llama': the model is a mixture of experts (model.moe is set); "
                              "LlamaForCausalLM has a dense MLP. Use arch='olmoe'")
    if arch == "llama" and cfg.qk_norm:
        raise ArchitectureError("arch = 'llama': the model has QK-norm (model.qk_norm = True) and "
                              "LlamaForCausalLM has none, so its logits would differ. Use arch='olmoe' "
                              "(one expert, top-1: exact)")
    if arch == "olmoe" and not cfg.qk_norm:
        raise ArchitectureError("arch = 'olmoe': the model has no QK-norm (model.qk_norm = False) and "
                              "OlmoeForCausalLM always applies it. Use arch='llama'")
    return arch


def _moe_or_single(cfg: ModelConfig) -> MoEConfig:
    """The MoE the HF model runs: ours, or for a dense model one expert of width d_ff, top-1."""
    return cfg.moe or MoEConfig(n_experts=1, top_k=1, d_expert=cfg.d_ff)


# ----------------------------------------------------------------------------- config

def to_hf_config(cfg: ModelConfig, arch: str, *, eos_id: Optional[int] = None,
                 pad_id: Optional[int] = None, dtype: str = "float32") -> dict:
    """config.json for ``arch``, in the released-checkpoint format (``rope_theta``, not
    ``rope_parameters``), which transformers 4.x reads directly and 5.x converts."""
    common = {
        "architectures": [_CLASS[arch]], "model_type": arch,
        "vocab_size": cfg.padded_vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "use_cache": True, "torch_dtype": dtype,
    }
    if arch == "llama":
        return {**common, "intermediate_size": cfg.d_ff, "mlp_bias": False, "pretraining_tp": 1}
    if arch == "olmo":
        return {**common, "intermediate_size": cfg.d_ff, "clip_qkv": None}
    moe = _moe_or_single(cfg)
    # transformers' OLMoE load-balancing loss is our "all_layers" form; "per_layer" is 1/k of it
    # at balance, so its coefficient goes over as ours over k (module doc)
    coef = moe.lb_loss_coef if moe.lb_loss_form == "all_layers" else moe.lb_loss_coef / moe.top_k
    return {**common, "intermediate_size": moe.d_expert, "num_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.norm_topk_probs, "clip_qkv": None,
            "output_router_logits": False, "router_aux_loss_coef": coef}


def from_hf_config(hf: dict, vocab_size: Optional[int] = None) -> ModelConfig:
    """Our ModelConfig for an HF config.json (olmoe, llama or olmo). ``vocab_size``: the tokenizer's
    (defaults to the HF embedding size); the padding multiple is chosen to reproduce it."""
    arch = hf.get("model_type")
    if arch not in ARCHITECTURES:
        raise ExportError(f"config.json model_type = {arch!r}: cannot import; supported: {', '.join(ARCHITECTURES)}")
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    if hf.get("rope_scaling") or (hf.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise ExportError("config.json: RoPE scaling is not supported by our model")
    padded = hf["vocab_size"]
    vocab = vocab_size or padded
    pad_to = 128 if (vocab + 127) // 128 * 128 == padded else padded
    n_heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // n_heads):
        raise ExportError(f"config.json head_dim = {hf['head_dim']}: ours is hidden_size / num_attention_heads")
    kv = hf.get("num_key_value_heads") or n_heads
    pad_id = hf.get("pad_token_id")
    base = dict(vocab_size=vocab, d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
                n_kv_heads=None if kv == n_heads else kv, max_seq_len=hf.get("max_position_embeddings", 4096),
                rope_theta=float(theta), norm_eps=hf.get("rms_norm_eps", 1e-5),
                init_std=hf.get("initializer_range", 0.02), pad_vocab_to=pad_to,
                pad_token_id=pad_id if isinstance(pad_id, int) and 0 <= pad_id < vocab else None)
    if arch == "llama":
        return ModelConfig(**base, d_ff=hf["intermediate_size"], qk_norm=False, moe=None)
    if arch == "olmo":
        if hf.get("clip_qkv") is not None:
            raise ExportError(f"config.json clip_qkv = {hf['clip_qkv']}: our model does not clip q, k, v")
        return ModelConfig(**{**base, "norm_eps": 1e-5}, d_ff=hf["intermediate_size"], qk_norm=False,
                           norm=LAYERNORM, moe=None)
    if hf["num_experts"] == 1:  # our dense export: one expert, top-1 (see the module docstring)
        return ModelConfig(**base, d_ff=hf["intermediate_size"], qk_norm=True, moe=None)
    # transformers' OLMoE trains with its load-balancing loss over every layer's router logits
    # (our "all_layers" form) weighed by router_aux_loss_coef, and no router z-loss
    moe = MoEConfig(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], d_expert=hf["intermediate_size"],
                    norm_topk_probs=bool(hf.get("norm_topk_prob", False)), lb_loss_form="all_layers",
                    lb_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)), z_loss_coef=0.0)
    return ModelConfig(**base, qk_norm=True, moe=moe)


# ----------------------------------------------------------------------------- weights

def _check_exportable(cfg: ModelConfig, state: dict) -> None:
    if cfg.moe is None:
        return
    biased = [k for k, v in state.items() if k.endswith("router.balance_bias") and bool(v.abs().max() > 0)]
    if biased:
        raise ExportError(f"{biased[0]}: non-zero aux-loss-free balancing bias (model.moe.bias_update_rate = "
                          f"{cfg.moe.bias_update_rate}); it changes which experts are chosen and HF routers have "
                          "no such bias, so the export would not be exact")
    if cfg.moe.capacity_factor is not None:
        warnings.warn(f"model.moe.capacity_factor = {cfg.moe.capacity_factor}: the HF model is dropless; "
                      "its outputs differ from ours wherever an expert overflowed its capacity", stacklevel=3)


def _layer_names(cfg: ModelConfig) -> dict[str, str]:
    """Our per-layer parameter names (after ``blocks.{i}.``) -> HF's (after ``model.layers.{i}.``),
    the feed-forward's aside."""
    names = {"attn.w_q.weight": "self_attn.q_proj.weight", "attn.w_k.weight": "self_attn.k_proj.weight",
             "attn.w_v.weight": "self_attn.v_proj.weight", "attn.w_o.weight": "self_attn.o_proj.weight"}
    if cfg.norm != LAYERNORM:
        names.update({"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"})
    if cfg.qk_norm:
        names.update({"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"})
    return names


def to_hf_state(cfg: ModelConfig, state: dict, arch: str) -> dict[str, torch.Tensor]:
    """Our state dict -> HF tensor names (contiguous copies, as safetensors needs)."""
    _check_exportable(cfg, state)
    out = {"model.embed_tokens.weight": state["embed.weight"], "lm_head.weight": state["lm_head.weight"]}
    if cfg.norm != LAYERNORM:
        out["model.norm.weight"] = state["final_norm.weight"]
    names = _layer_names(cfg)
    for i in range(cfg.n_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        out.update({hf + h: state[ours + o] for o, h in names.items()})
        if arch in ("llama", "olmo"):
            for proj in ("gate", "up", "down"):
                out[f"{hf}mlp.{proj}_proj.weight"] = state[f"{ours}ffn.w_{proj}.weight"]
        elif cfg.moe is None:  # dense as one OLMoE expert; the router's one logit is irrelevant
            out[hf + "mlp.gate.weight"] = torch.zeros(1, cfg.d_model, dtype=state[ours + "ffn.w_up.weight"].dtype)
            for proj in ("gate", "up", "down"):
                out[f"{hf}mlp.experts.0.{proj}_proj.weight"] = state[f"{ours}ffn.w_{proj}.weight"]
        else:
            F = cfg.moe.d_expert
            E = cfg.moe.n_experts  # the stored rows as (E, rows, cols): optimus_core.model.experts
            w_up, w_down = (state[ours + f"ffn.experts.{n}"].reshape(E, -1, state[ours + f"ffn.experts.{n}"].shape[-1])
                            for n in ("w_up", "w_down"))
            out[hf + "mlp.gate.weight"] = state[ours + "ffn.router.gate.weight"]
            for e in range(cfg.moe.n_experts):
                out[f"{hf}mlp.experts.{e}.gate_proj.weight"] = w_up[e, :, :F].T
                out[f"{hf}mlp.experts.{e}.up_proj.weight"] = w_up[e, :, F:].T
                out[f"{hf}mlp.experts.{e}.down_proj.weight"] = w_down[e].T
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf_state(cfg: ModelConfig, hf: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """HF tensors (per-expert or transformers-5 fused ``gate_up_proj``) -> our state dict."""
    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ExportError(f"weights: missing tensor {name!r} (is this a {_CLASS[arch]} checkpoint of this config?)")
        return hf[name]

    out = {"embed.weight": take("model.embed_tokens.weight"), "lm_head.weight": take("lm_head.weight")}
    names = _layer_names(cfg)
    if cfg.norm != LAYERNORM:
        out["final_norm.weight"] = take("model.norm.weight")
    moe = _moe_or_single(cfg)
    for i in range(cfg.n_layers):
        ours, p = f"blocks.{i}.", f"model.layers.{i}."
        out.update({ours + o: take(p + h) for o, h in names.items()})
        if arch in ("llama", "olmo"):
            for proj in ("gate", "up", "down"):
                out[f"{ours}ffn.w_{proj}.weight"] = take(f"{p}mlp.{proj}_proj.weight")
            continue
        if p + "mlp.experts.gate_up_proj" in hf:  # transformers 5 save_pretrained: (E, 2F, D), (E, D, F)
            gate_up, down = hf[p + "mlp.experts.gate_up_proj"], take(p + "mlp.experts.down_proj")
            gates, ups = gate_up[:, :moe.d_expert], gate_up[:, moe.d_expert:]
            downs = down
        else:
            e_range = range(moe.n_experts)
            gates = torch.stack([take(f"{p}mlp.experts.{e}.gate_proj.weight") for e in e_range])
            ups = torch.stack([take(f"{p}mlp.experts.{e}.up_proj.weight") for e in e_range])
            downs = torch.stack([take(f"{p}mlp.experts.{e}.down_proj.weight") for e in e_range])
        if cfg.moe is None:
            out.update({ours + "ffn.w_gate.weight": gates[0], ours + "ffn.w_up.weight": ups[0],
                        ours + "ffn.w_down.weight": downs[0]})
        else:
            out[ours + "ffn.router.gate.weight"] = take(p + "mlp.gate.weight")
            out[ours + "ffn.router.balance_bias"] = torch.zeros(moe.n_experts)
            # (E, D, 2F) and (E, F, D), stored as rows (optimus_core.model.experts)
            out[ours + "ffn.experts.w_up"] = torch.cat([gates, ups], dim=1).transpose(1, 2).reshape(-1, 2 * moe.d_expert)
            out[ours + "ffn.experts.w_down"] = downs.transpose(1, 2).reshape(-1, cfg.d_model)
    return {k: v.contiguous().clone() for k, v in out.items()}


# ----------------------------------------------------------------------------- tokenizer files

def _tokenizer_files(tmp: Path, tokenizer_json: Path, *, eos: str, pad: str, max_len: int) -> None:
    shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
    special = {"eos_token": eos, "pad_token": pad, "bos_token": None, "unk_token": None}
    (tmp / "special_tokens_map.json").write_text(json.dumps({k: v for k, v in special.items() if v}, indent=2))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_len,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=2))


def _special_tokens(data_dir: Path) -> tuple[int, int, str, str]:
    """(eos_id, pad_id, eos_token, pad_token) from a tokenize output's manifest."""
    from tokenizers import Tokenizer

    from .data import load_manifest

    m = load_manifest(data_dir)
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    return m.eos_id, m.pad_id, tok.id_to_token(m.eos_id), tok.id_to_token(m.pad_id)


# ----------------------------------------------------------------------------- export / import

def export_hf(run_dir: Union[str, Path], out_dir: Union[str, Path], *, arch: Optional[str] = None,
              data_dir: Union[str, Path, None] = None) -> Path:
    """Write ``out_dir``: config.json, model.safetensors, tokenizer files, optimus.json.

    ``run_dir``: any run directory ``optimus_core.load_model`` reads (newest valid checkpoint).
    ``data_dir``: the tokenize output whose tokenizer.json / manifest.json to ship (default: the
    run's ``data.path``). Built in a temporary sibling and renamed: never half-written.

        >>> export_hf("results/runs/smoke", "/tmp/smoke-hf")
        PosixPath('/tmp/smoke-hf')
    """
    save_file = _safetensors().save_file

    from .train.checkpoint import load_model

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / "meta.json").is_file() and not (run_dir / "checkpoints").is_dir():
        raise ExportError(f"{run_dir}: not a run directory (no meta.json, no checkpoints/)")
    check_output(out_dir, "export-hf", [run_dir, data_dir], recognise=lambda p: (p / OPTIMUS_META).is_file())
    try:
        model, run_cfg, step = load_model(run_dir, with_step=True)
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    cfg = run_cfg.model
    arch = hf_architecture(cfg, arch)
    if data_dir is None:  # the run's own data: the output may not overlap it either
        data_dir = Path(run_cfg.data.path)
        check_output(out_dir, "export-hf", [data_dir], recognise=lambda p: (p / OPTIMUS_META).is_file())
    data_dir = Path(data_dir)
    if (data_dir / "manifest.json").is_file():  # the package ships this tokenizer: the run's own
        from .data.identity import check_tokenizer, trained_tokenizer
        from .train.checkpoint import newest_meta

        try:
            check_tokenizer(data_dir, trained_tokenizer(newest_meta(run_dir) or {}), f"run {run_dir}")
        except ValueError as e:
            raise ExportError(str(e)) from None
    if not (data_dir / "tokenizer.json").is_file():
        raise ExportError(f"{data_dir}/tokenizer.json: missing; the export ships the run's tokenizer "
                          "(pass data_dir= / --data with the `optimus tokenize` output the run used)")
    eos_id, pad_id, eos, pad = _special_tokens(data_dir)
    state = {k: v.float() for k, v in model.state_dict().items()}
    tensors = to_hf_state(cfg, state, arch)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out_dir) as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_text(json.dumps(to_hf_config(cfg, arch, eos_id=eos_id, pad_id=pad_id), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False}, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors writes through a private temporary file: readable as the directory's other files
        shutil.copymode(tmp / "config.json", tmp / "model.safetensors")
        _tokenizer_files(tmp, data_dir / "tokenizer.json", eos=eos, pad=pad, max_len=cfg.max_seq_len)
        mark_output(tmp, "export-hf", {"run_dir": run_dir, "data_dir": data_dir})
        (tmp / OPTIMUS_META).write_text(json.dumps(
            {"model": cfg.to_dict(), "run_dir": str(run_dir), "step": step, "arch": arch}, indent=2))
    return out_dir


def import_hf(hf_dir: Union[str, Path]):
    """``(Transformer, ModelConfig)`` with the weights of an HF directory (ours or OLMoE-style),
    the model plain (optimus_core.execution.parallelize applies a plan to it).

    The config comes from ``optimus.json`` when the directory is one of our exports (exact),
    else from config.json. Use the model's ``state_dict()`` as initial weights of a new run.

        >>> model, cfg = import_hf("/tmp/smoke-hf")
    """
    load_file = _safetensors().load_file

    from .model.transformer import Transformer

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ExportError(f"{hf_dir}: not a Hugging Face model directory (no config.json)")
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    meta = hf_dir / OPTIMUS_META
    if meta.is_file():
        cfg = from_dict(ModelConfig, json.loads(meta.read_text())["model"], "model")
    else:
        vocab = None
        if (hf_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer
            vocab = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        cfg = from_hf_config(hf_cfg, vocab if vocab and vocab <= hf_cfg["vocab_size"] else None)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{hf_dir}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    arch = hf_cfg.get("model_type")
    if arch not in ARCHITECTURES:
        raise ExportError(f"{hf_dir}/config.json model_type = {arch!r}: cannot import; supported: {', '.join(ARCHITECTURES)}")
    state = from_hf_state(cfg, tensors, arch)
    model = Transformer(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg
