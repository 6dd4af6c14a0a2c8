#!/usr/bin/env python3
"""What one transformer block keeps for its backward, tensor by tensor, with no compute.

    python bench/saved_activations.py [--preset mula-7b-a1b] [--tokens 8192] [--seq 4096]
                                      [--backend triton] [--qk-norm-rope triton|torch]
                                      [--residual bfloat16|float32] [--set model.moe.KEY=VALUE]

Runs one block's forward under bf16 autocast on fake tensors (torch's FakeTensorMode: shapes and
dtypes only, so the full OLMoE width at 8192 tokens costs no memory and no time), the residual
stream in bf16 (the default) or float32 (execution.fp32_residual), and records
every tensor autograd saves (torch.autograd.graph.saved_tensors_hooks), deduplicated by
storage: the eager forward's activation memory, per tensor and in total. Parameters and the
experts' weight copies are listed apart, since they live whether or not a backward follows.
Compiled blocks may save another set (the partitioner recomputes cheap pointwise ops), so this
is the eager count, on the CPU's autocast and attention paths (fake CPU tensors: a CPU-only
torch cannot make fake CUDA ones). The triton backend's custom ops run their fake
implementations; their launch checks accept CPU tensors under TRITON_INTERPRET=1, which the
script sets for itself.

Output: a table on stdout (MiB, dtype, shape, the autograd node that saved it) and one JSON line
on stdout's last line: {"activations_gib": ..., "per_tensor": [...]}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # before kernels is imported (it reads the variable once)
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # an uninstalled checkout: its packages, the kernels' source root

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from optimus_core import presets  # noqa: E402
from optimus_core.execution import use_kernels  # noqa: E402
from optimus_core.execution.weight_copies import keep_expert_copies  # noqa: E402
from optimus_core.model.transformer import Transformer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="mula-7b-a1b")
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the micro-batch")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (tokens / seq sequences)")
    p.add_argument("--backend", default="triton", choices=["loop", "torch", "triton"], help="experts backend")
    p.add_argument("--qk-norm-rope", default="triton", choices=["torch", "triton"],
                   help="execution.qk_norm_rope: the QK-norm and RoPE by the kernel or by torch ops")
    p.add_argument("--residual", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the residual stream's dtype (execution.fp32_residual: float32)")
    p.add_argument("--set", action="append", default=[], metavar="model.moe.KEY=VALUE",
                   help="a model.moe field, e.g. model.moe.top_k=4")
    return p.parse_args(argv)


def _value(text: str):
    return {"true": True, "false": False}.get(text.lower(), text)


def saved_tensors(preset: str, tokens: int, seq: int, backend: str, moe_overrides: dict,
                  qk_norm_rope: str = "triton", residual: str = "bfloat16") -> list[dict]:
    """One record per distinct storage saved by one block's forward: bytes, dtype, shape, the
    autograd node that saved it and whether it is a parameter or weight copy."""
    cfg = presets.get(preset).model
    if tokens % seq:
        raise ValueError(f"--tokens {tokens} must be a multiple of --seq {seq}")
    moe = dataclasses.replace(cfg.moe, **moe_overrides) if cfg.moe else None
    cfg = dataclasses.replace(cfg, n_layers=1, moe=moe, max_seq_len=max(cfg.max_seq_len, seq))
    records: dict[int, dict] = {}

    def pack(t: torch.Tensor):
        # one entry per storage: views of one tensor saved by several nodes count once
        records.setdefault(t.untyped_storage()._cdata, {"tensor": t, "node": type(t.grad_fn).__name__ if t.grad_fn else "input"})
        return t

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = Transformer(cfg)
        use_kernels(model, experts=backend, qk_norm_rope=qk_norm_rope == "triton" and cfg.qk_norm)
        if cfg.moe:
            keep_expert_copies(model, torch.bfloat16)  # as training keeps them (the plan's expert copies)
        block = model.blocks["0"]
        cos, sin = model.rope(seq)
        x = torch.randn(tokens // seq, seq, cfg.d_model, dtype=getattr(torch, residual), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x, cos, sin)
        weights = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    return [{"bytes": r["tensor"].untyped_storage().nbytes(), "dtype": str(r["tensor"].dtype).removeprefix("torch."),
             "shape": list(r["tensor"].shape), "node": r["node"], "weight": key in weights}
            for key, r in records.items()]


def main(argv=None) -> None:
    args = parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if not key.startswith("model.moe.") or not value:
            sys.exit(f"--set {item!r}: expected model.moe.KEY=VALUE")
        overrides[key.removeprefix("model.moe.")] = _value(value)
    rows = saved_tensors(args.preset, args.tokens, args.seq, args.backend, overrides, args.qk_norm_rope,
                         args.residual)
    print(f"{'MiB':>9} {'dtype':>9}  {'shape':<22} saved by")
    for r in sorted(rows, key=lambda r: -r["bytes"]):
        tag = "  (weight)" if r["weight"] else ""
        print(f"{r['bytes'] / 2**20:9.1f} {r['dtype']:>9}  {str(tuple(r['shape'])):<22} {r['node']}{tag}")
    activations = sum(r["bytes"] for r in rows if not r["weight"])
    print(f"activations saved by one block (eager, weights apart): {activations / 2**30:.3f} GiB")
    print(json.dumps({"preset": args.preset, "tokens": args.tokens, "seq": args.seq, "backend": args.backend,
                      "qk_norm_rope": args.qk_norm_rope, "residual": args.residual,
                      "moe_overrides": overrides, "activations_gib": activations / 2**30, "per_tensor": rows}))


if __name__ == "__main__":
    main()
