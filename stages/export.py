"""Stage `export`: a run's newest checkpoint as a Hugging Face transformers model directory.

    run_export(ExportConfig(), ExportInputs(run_dir=Path("results/runs/x")),
               ExportOutputs(out_dir=Path("results/hf/x")))
    # then: transformers.AutoModelForCausalLM.from_pretrained("results/hf/x")

The conversion (and why MoE and dense models both become ``OlmoeForCausalLM``) lives in
optimus_core.hf; this stage only names its inputs and outputs (the house rules: declared inputs
and outputs only).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from optimus_core.hf import ARCHITECTURES, ExportError, export_hf


@dataclass
class ExportConfig:
    arch: Optional[str] = None  # None: the exact architecture for the model (see optimus_core.hf)

    def __post_init__(self):
        if self.arch is not None and self.arch not in ARCHITECTURES:
            raise ExportError(f"arch = {self.arch!r}: unknown; known: {', '.join(ARCHITECTURES)}")


@dataclass
class ExportInputs:
    run_dir: Path
    data_dir: Optional[Path] = None  # the tokenizer's tokenize output; default: the run's data.path


@dataclass
class ExportOutputs:
    out_dir: Path


@dataclass
class ExportResult:
    out_dir: Path
    arch: str
    step: int


def run_export(config: ExportConfig, inputs: ExportInputs, outputs: ExportOutputs) -> ExportResult:
    out = export_hf(inputs.run_dir, outputs.out_dir, arch=config.arch, data_dir=inputs.data_dir)
    meta = json.loads((out / "optimus.json").read_text())
    return ExportResult(out, meta["arch"], meta["step"])
