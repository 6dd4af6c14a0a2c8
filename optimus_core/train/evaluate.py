"""Held-out loss, perplexity and bits per byte, per corpus source of the validation split."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ..data import heldout_batches, load_manifest
from .step import autocast_context


@torch.no_grad()
def heldout_metrics(model: torch.nn.Module, data_dir, *, seq_len: int, batch_size: int, max_batches: int,
                    dtype: str = "float32", device: torch.device | str = "cpu",
                    loss_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    counts: dict | None = None) -> dict[str, float]:
    """``{"loss.<source>", "ppl.<source>", "bpb.<source>", ..., "loss", "ppl", "bpb"}``.

    ``loss_sum(batch_BS1)``: the summed cross entropy of a batch, where ``model`` is one part of
    the model (a pipeline stage: parallel.pipeline.Pipeline.loss_sum, under the run's autocast);
    default: ``model``'s logits under ``dtype``'s autocast. ``counts``: where given, its
    "batches" and "sequences" are increased by what was evaluated (at most ``max_batches``
    batches of ``batch_size`` sequences per source: a different count gives a different mean).

    Every source's loss is the mean cross entropy (nats) over its held-out tokens; the overall
    ``loss`` weighs sources by their token counts. Bits per byte divide the total bits by the
    UTF-8 bytes those tokens encode, using the split's bytes-per-token ratio from the manifest.
    """
    manifest = load_manifest(data_dir)
    was_training = model.training
    model.eval()
    device = torch.device(device)
    row: dict[str, float] = {}
    all_nll = all_tokens = all_bytes = 0.0
    for source in manifest.sources:
        nll = n_tokens = 0.0
        for batch_BS1 in heldout_batches(data_dir, source, seq_len, batch_size, max_batches):
            batch_BS1 = batch_BS1.to(device)
            targets_BS = batch_BS1[:, 1:]
            if loss_sum is not None:
                nll += loss_sum(batch_BS1).item()
            else:
                with autocast_context(device.type, dtype):
                    logits_BSV = model(batch_BS1[:, :-1])
                nll += F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(), reduction="sum").item()
            n_tokens += targets_BS.numel()
            if counts is not None:
                counts["batches"] = counts.get("batches", 0) + 1
                counts["sequences"] = counts.get("sequences", 0) + batch_BS1.shape[0]
        if n_tokens == 0:
            continue  # a source too small to hold out one sequence: reported as absent
        val = manifest.totals["val"][source]
        bytes_per_token = val.bytes / max(val.tokens, 1)
        loss = nll / n_tokens
        row[f"loss.{source}"] = loss
        row[f"ppl.{source}"] = math.exp(loss)
        row[f"bpb.{source}"] = loss / math.log(2) / bytes_per_token
        all_nll, all_tokens, all_bytes = all_nll + nll, all_tokens + n_tokens, all_bytes + n_tokens * bytes_per_token
    if all_tokens:
        row["loss"] = all_nll / all_tokens
        row["ppl"] = math.exp(row["loss"])
        row["bpb"] = all_nll / math.log(2) / all_bytes
    model.train(was_training)
    return row
